"""Ephemeral client secrets: `POST /v1/realtime/client_secrets` (with the API key) returns a key that the realtime
WebSocket and WebRTC endpoints (and anything else that calls `valid`) take in place of the API key until it expires,
so a browser app never holds the API key.

A secret is signed, not stored: `ek_<expires_at>_<nonce>_<signature>`, the signature an HMAC of the first two parts
under a key derived from the server's API keys. Every worker of a `--workers` server (same settings) accepts every
secret, a restart keeps them valid until they expire, and changing the API keys revokes them all.

Session settings given with a secret (OpenAI's browser examples set the voice, instructions... there) travel in it,
signed too: `ek_<expires_at>_<nonce>_<signature>_<settings>`, the settings compressed JSON in base64url (at most
MAX_SETTINGS characters: larger ones, and voice prompts, go in a session.update once connected). A session opened
with such a secret applies them as its first session.update.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
import zlib
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engines.protocol import errors
from server import auth
from server.session import server_events as ev
from server.session.client_events import SessionConfig, parse_session_update
from server.session.client_json import ProtocolError

PREFIX = auth.CLIENT_SECRET_PREFIX
DEFAULT_TTL_S = 600  # OpenAI's default
MIN_TTL_S, MAX_TTL_S = 10, 7200  # OpenAI's bounds
MAX_SETTINGS = 4096  # characters of encoded session settings in a secret (a header's worth)


def _signing_key(api_keys: Sequence[str]) -> bytes:
    return hashlib.sha256(b"moss-speech client secret\0" + "\0".join(sorted(api_keys)).encode()).digest()


def _signature(api_keys: Sequence[str], expires_at: int, nonce: str, settings: str = "") -> str:
    signed = f"{expires_at}_{nonce}" + (f"_{settings}" if settings else "")
    return hmac.new(_signing_key(api_keys), signed.encode(), hashlib.sha256).hexdigest()


def encode_settings(session: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(session, separators=(",", ":")).encode())).decode(
        ).rstrip("=")


def issue(api_keys: Sequence[str], ttl_s: int, now: float | None = None, settings: str = "") -> tuple[str, int]:
    """A new secret valid for `ttl_s` seconds (carrying `encode_settings` of a session's settings, if any): (value,
    expires_at in Unix seconds)."""
    expires_at = int(now if now is not None else time.time()) + ttl_s
    nonce = secrets.token_hex(12)
    tail = f"_{settings}" if settings else ""
    return f"{PREFIX}{expires_at}_{nonce}_{_signature(api_keys, expires_at, nonce, settings)}{tail}", expires_at


def _checked(api_keys: Sequence[str], value: str | None, now: float | None) -> str | None:
    """The encoded settings of a valid secret ("" for none); None if `value` is not one."""
    if not value or not value.startswith(PREFIX):
        return None
    parts = value[len(PREFIX):].split("_", 3)  # (base64url settings may hold "_")
    if len(parts) not in (3, 4) or not parts[0].isdigit():
        return None
    expires_at, nonce, sig, settings = int(parts[0]), parts[1], parts[2], parts[3] if len(parts) == 4 else ""
    if expires_at <= (now if now is not None else time.time()):
        return None
    ok = hmac.compare_digest(sig.encode(), _signature(api_keys, expires_at, nonce, settings).encode())
    return settings if ok else None


def valid(api_keys: Sequence[str], value: str | None, now: float | None = None) -> bool:
    """Whether `value` is a secret this server issued (under these API keys) that has not expired."""
    return _checked(api_keys, value, now) is not None


def session_settings(api_keys: Sequence[str], value: str | None, now: float | None = None) -> dict[str, Any] | None:
    """The session settings a valid secret carries (None: none, or not a valid secret)."""
    settings = _checked(api_keys, value, now)
    if not settings:
        return None
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(settings + "=" * (-len(settings) % 4))))


def _error(code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": errors.error_type(code), "code": code, "message": message}},
                        status_code=errors.http_status(code))


def _ttl(body: dict[str, Any]) -> int | str:
    """The lifetime asked for, or a message saying what is wrong with it."""
    after = body.get("expires_after")
    if after is None:
        return DEFAULT_TTL_S
    if not isinstance(after, dict) or after.get("anchor", "created_at") != "created_at":
        return "expires_after must be {\"anchor\": \"created_at\", \"seconds\": N}"
    seconds = after.get("seconds", DEFAULT_TTL_S)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_TTL_S <= seconds <= MAX_TTL_S:
        return f"expires_after.seconds must be an integer in [{MIN_TTL_S}, {MAX_TTL_S}]"
    return seconds


def _with_settings(session: dict[str, Any], config: SessionConfig) -> SessionConfig | JSONResponse:
    """`config` with the settings a secret is to carry; or the refusal of settings it cannot carry: any that a
    session.update would refuse (the first, as its error), and voice prompts (recordings: too large for a key)."""
    moss = session.get("moss")
    if isinstance(moss, dict) and moss.get("voice_prompt") is not None:
        return _error(errors.INVALID_VALUE, "a voice prompt cannot travel in a client secret: send it in "
                      "session.update once connected")
    try:
        config, refused = parse_session_update(session, config)
    except ProtocolError as e:
        refused = [e]
    if refused:
        e = refused[0]
        return _error(e.code, f"{e.message} ({e.param})" if e.param else e.message)
    return config


def install(app: FastAPI, settings: Any) -> None:
    """Add `POST /v1/realtime/client_secrets`, and accept the secrets it issues wherever a key is asked for
    (auth.request_authorized)."""
    app.state.client_secret_ok = lambda value: valid(getattr(settings, "api_keys", []), value)

    async def create(request: Request) -> JSONResponse:
        keys = getattr(settings, "api_keys", [])
        if not auth.key_ok(keys, auth.presented_key(request.headers, request.query_params)):
            return _error(errors.INVALID_API_KEY, "missing or wrong API key (Authorization: Bearer KEY)")
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            return _error(errors.INVALID_VALUE, "the body must be JSON")
        if not isinstance(body, dict) or set(body) - {"expires_after", "session"}:
            return _error(errors.INVALID_VALUE, "the body takes expires_after and session")
        session = body.get("session") or {}
        ttl = _ttl(body)
        if isinstance(ttl, str):
            return _error(errors.INVALID_VALUE, ttl)
        config = SessionConfig(model=getattr(settings, "model_name", "moss-speech"))
        carried = ""
        if isinstance(session, dict) and set(session) - {"type", "model"}:
            config = _with_settings(session, config)
            if isinstance(config, JSONResponse):
                return config
            carried = encode_settings(session)
            if len(carried) > MAX_SETTINGS:
                return _error(errors.INVALID_VALUE, f"the session settings are too large to travel in a client secret "
                              f"({len(carried)} of {MAX_SETTINGS} characters encoded): send them in session.update "
                              "once connected")
        elif not isinstance(session, dict) or session.get("type", "realtime") != "realtime":
            return _error(errors.UNSUPPORTED_SESSION_TYPE, "session must be an object of type 'realtime'")
        value, expires_at = issue(keys, ttl, settings=carried)
        sid = ev.new_id("sess")
        sess = {"id": sid, "object": "realtime.session", "expires_at": expires_at, **ev.session_obj(sid, config)}
        return JSONResponse({"value": value, "expires_at": expires_at, "session": sess})

    app.add_api_route("/v1/realtime/client_secrets", create, methods=["POST"])
