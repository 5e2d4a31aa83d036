"""API keys and Origin checks for HTTP and WebSocket requests.

A key is accepted from `Authorization: Bearer KEY` (API clients, the openai SDK), from the WebSocket
subprotocol `openai-insecure-api-key.KEY` (browsers cannot set headers on a WebSocket), or from the
`api_key` query parameter. With no key configured, none is required. Where a key is required, an ephemeral client
secret, presented the same ways, is accepted instead when the app's `state.client_secret_ok` (whatever issues
them sets it) accepts it: `request_authorized` is the one check every route makes.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping, Sequence
from typing import Any

KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
# Ephemeral client secrets (POST /v1/realtime/client_secrets) start with this, as OpenAI's do: logs redact them.
CLIENT_SECRET_PREFIX = "ek_"


def offered_subprotocols(headers: Mapping[str, str]) -> list[str]:
    raw = headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for p in offered_subprotocols(headers):
        if p.startswith(KEY_SUBPROTOCOL_PREFIX):
            return p[len(KEY_SUBPROTOCOL_PREFIX):]
    return query.get("api_key")


def key_ok(keys: Sequence[str], presented: str | None) -> bool:
    if not keys:
        return True
    if not presented:
        return False
    return any(hmac.compare_digest(presented.encode(), k.encode()) for k in keys)


ClientSecretCheck = Callable[[str], bool]  # True for a live (issued, unexpired) client secret


def credential_ok(keys: Sequence[str], presented: str | None, client_secret_ok: ClientSecretCheck | None = None
                  ) -> bool:
    """No key configured; or `presented` is one of `keys`, or a client secret `client_secret_ok` accepts."""
    if key_ok(keys, presented):
        return True
    return presented is not None and client_secret_ok is not None and client_secret_ok(presented)


def request_authorized(keys: Sequence[str], state: Any, headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
    """A request's credential (key or client secret) against `keys`, with the app `state`'s client secrets."""
    return credential_ok(keys, presented_key(headers, query), getattr(state, "client_secret_ok", None))


def origin_ok(allowed: Sequence[str], origin: str | None) -> bool:
    """Browsers always send Origin on WebSockets; non-browser clients usually send none and are allowed."""
    if not allowed or "*" in allowed or origin is None:
        return True
    return origin.rstrip("/") in {a.rstrip("/") for a in allowed}
