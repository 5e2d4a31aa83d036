"""A client event's text (a WebSocket frame, a data channel message) -> the event object, and the error every check of
a client's event raises (`ProtocolError`: an `error` event for the client, the session goes on)."""

from __future__ import annotations

import json
from typing import Any

from engines.protocol import errors
from server.session.json_depth import MAX_DEPTH, deeper_than


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _not_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _lone_surrogate(x: Any) -> bool:
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(x, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in x.items())
    if isinstance(x, list):
        return any(_lone_surrogate(v) for v in x)
    return False


def decode_client_event(text: str | bytes) -> dict[str, Any]:
    """A client event's JSON text (a WebSocket frame, a data channel message) -> the event object.

    ProtocolError `invalid_json` for text that is not strict JSON (NaN and Infinity are not JSON) or that escapes a
    lone UTF-16 surrogate (valid JSON syntax, but no UTF-8 string: it could reach no engine message or log) or that
    nests arrays and objects more than MAX_DEPTH deep, `invalid_event` for JSON that is not an object."""
    if deeper_than(text):
        raise ProtocolError(errors.INVALID_JSON, f"message nests arrays and objects more than {MAX_DEPTH} deep")
    try:
        event = json.loads(text, parse_constant=_not_json_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (bytes), NaN / Infinity
        raise ProtocolError(errors.INVALID_JSON, f"message is not valid JSON: {e}") from None
    # Only an escape can make a surrogate (UTF-8 text cannot carry one); base64 audio has no backslash.
    if (b"\\u" in text if isinstance(text, bytes) else "\\u" in text) and _lone_surrogate(event):
        raise ProtocolError(errors.INVALID_JSON, "message escapes a lone UTF-16 surrogate (\\ud800-\\udfff unpaired)")
    if not isinstance(event, dict):
        raise ProtocolError(errors.INVALID_EVENT, "a client event must be a JSON object")
    return event
