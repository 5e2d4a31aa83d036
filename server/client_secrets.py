"""Ephemeral client secrets: `POST /v1/realtime/client_secrets` (with the API key) returns a key that the realtime
WebSocket and WebRTC endpoints (and anything else that calls `valid`) take in place of the API key until it expires,
so a browser app never holds the API key.

A secret is signed, not stored: `ek_<expires_at>_<nonce>_<signature>`, the signature an HMAC of the first two parts
under a key derived from the server's API keys. Every worker of a `--workers` server (same settings) accepts every
secret, a restart keeps them valid until they expire, and changing the API keys revokes them all.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engines.protocol import errors
from server import auth
from server.session import server_events as ev
from server.session.client_events import SessionConfig

PREFIX = auth.CLIENT_SECRET_PREFIX
DEFAULT_TTL_S = 600  # OpenAI's default
MIN_TTL_S, MAX_TTL_S = 10, 7200  # OpenAI's bounds


def _signing_key(api_keys: Sequence[str]) -> bytes:
    return hashlib.sha256(b"moss-speech client secret\0" + "\0".join(sorted(api_keys)).encode()).digest()


def _signature(api_keys: Sequence[str], expires_at: int, nonce: str) -> str:
    return hmac.new(_signing_key(api_keys), f"{expires_at}_{nonce}".encode(), hashlib.sha256).hexdigest()


def issue(api_keys: Sequence[str], ttl_s: int, now: float | None = None) -> tuple[str, int]:
    """A new secret valid for `ttl_s` seconds: (value, expires_at in Unix seconds)."""
    expires_at = int(now if now is not None else time.time()) + ttl_s
    nonce = secrets.token_hex(12)
    return f"{PREFIX}{expires_at}_{nonce}_{_signature(api_keys, expires_at, nonce)}", expires_at


def valid(api_keys: Sequence[str], value: str | None, now: float | None = None) -> bool:
    """Whether `value` is a secret this server issued (under these API keys) that has not expired."""
    if not value or not value.startswith(PREFIX):
        return False
    parts = value[len(PREFIX):].split("_")
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    expires_at, nonce, sig = int(parts[0]), parts[1], parts[2]
    if expires_at <= (now if now is not None else time.time()):
        return False
    return hmac.compare_digest(sig.encode(), _signature(api_keys, expires_at, nonce).encode())


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
        if not isinstance(session, dict) or set(session) - {"type", "model"} \
                or session.get("type", "realtime") != "realtime":
            # Sessions are set up over the connection: a secret carries no settings.
            return _error(errors.UNSUPPORTED_PARAMETER, "a client secret carries no session settings here: send "
                          "them in session.update once connected (session takes only type 'realtime' and model)")
        ttl = _ttl(body)
        if isinstance(ttl, str):
            return _error(errors.INVALID_VALUE, ttl)
        value, expires_at = issue(keys, ttl)
        sid = ev.new_id("sess")
        sess = {"id": sid, "object": "realtime.session", "expires_at": expires_at,
                **ev.session_obj(sid, SessionConfig(model=getattr(settings, "model_name", "moss-speech")))}
        return JSONResponse({"value": value, "expires_at": expires_at, "session": sess})

    app.add_api_route("/v1/realtime/client_secrets", create, methods=["POST"])
