"""API keys and Origin checks for HTTP and WebSocket requests.

A key is accepted from `Authorization: Bearer KEY` (API clients, the openai SDK), from the WebSocket
subprotocol `openai-insecure-api-key.KEY` (browsers cannot set headers on a WebSocket), or from the
`api_key` query parameter. With no key configured, none is required.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

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


def origin_ok(allowed: Sequence[str], origin: str | None) -> bool:
    """Browsers always send Origin on WebSockets; non-browser clients usually send none and are allowed."""
    if not allowed or "*" in allowed or origin is None:
        return True
    return origin.rstrip("/") in {a.rstrip("/") for a in allowed}
