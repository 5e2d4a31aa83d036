"""WebRTC settings: ICE (STUN/TURN) servers, call limit, timeouts, the outbound jitter buffer, the page folder.

ICE servers use the browser's `RTCIceServer` JSON shape, so the same list configures aiortc and is handed to
the page (`GET /v1/info`), e.g.
  [{"urls": "stun:stun.example.org:3478"},
   {"urls": ["turn:turn.example.org:3478?transport=udp"], "username": "u", "credential": "p"}]
An empty list (the default) means host candidates only: enough for localhost and a LAN.

TURN credentials: with `turn_secret` set (coturn's `use-auth-secret` / `static-auth-secret`), TURN servers are given
without a username and credential and each client, and each call of the server's own peer, gets time-limited ones
(the TURN REST API: username `EXPIRY:moss`, credential base64(HMAC-SHA1(secret, username)), valid `turn_ttl_s`).
A static username and credential, the alternative, is the same password for every client.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from aiortc import RTCConfiguration, RTCIceServer

# The page's package data where it is installed (a checkout's own folder under an editable install). Installed
# packages are folders on disk, so the resource is a real path, as StaticFiles needs.
DEFAULT_WEB_ROOT = Path(str(resources.files("client_web")))
_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")
_TURN = ("turn:", "turns:")
TURN_USER = "moss"  # the user part of a time-limited username (coturn logs it; it grants nothing)


class WebRTCConfigError(ValueError):
    pass


@dataclass(frozen=True)
class IceServer:
    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise WebRTCConfigError("an ICE server needs at least one URL")
        for u in self.urls:
            if not isinstance(u, str) or not u.startswith(_SCHEMES):
                raise WebRTCConfigError(f"ICE server URL {u!r} must start with one of {', '.join(_SCHEMES)}")

    @property
    def turn(self) -> bool:
        return any(u.startswith(_TURN) for u in self.urls)

    @property
    def static_credential(self) -> bool:
        return bool(self.username or self.credential)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"urls": list(self.urls)}
        if self.username is not None:
            d["username"] = self.username
        if self.credential is not None:
            d["credential"] = self.credential
        return d


def turn_rest_credential(secret: str, expiry: int, user: str = TURN_USER) -> tuple[str, str]:
    """The TURN REST API's (username, credential) valid until `expiry` (Unix seconds), from the shared secret."""
    username = f"{expiry}:{user}"
    digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode("ascii")


def parse_ice_servers(value: str | list[Any] | tuple[Any, ...] | None) -> tuple[IceServer, ...]:
    """A JSON string or list in RTCIceServer shape -> validated servers."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise WebRTCConfigError(f"ICE servers must be a JSON list of {{urls, username, credential}}: {e}") from None
    if not isinstance(value, list | tuple):
        raise WebRTCConfigError("ICE servers must be a list")
    out = []
    for i, s in enumerate(value):
        if not isinstance(s, dict) or "urls" not in s or set(s) - {"urls", "username", "credential"}:
            raise WebRTCConfigError(f"ICE server #{i} must be an object with urls and optional username, credential")
        urls = s["urls"]
        urls = (urls,) if isinstance(urls, str) else tuple(urls)
        out.append(IceServer(urls, s.get("username"), s.get("credential")))
    return tuple(out)


@dataclass(frozen=True)
class WebRTCConfig:
    ice_servers: tuple[IceServer, ...] = ()
    max_calls: int = 16
    ice_timeout_s: float = 20.0  # a call whose ICE has not connected by then is closed
    prebuffer_ms: int = 60  # outbound jitter buffer before an answer starts playing
    web_root: Path = field(default=DEFAULT_WEB_ROOT)
    turn_secret: str | None = None  # TURN REST API shared secret: time-limited TURN credentials
    turn_ttl_s: int = 86400  # how long a time-limited TURN credential is valid (a call must not outlive it)

    def __post_init__(self) -> None:
        if self.max_calls < 0:
            raise WebRTCConfigError(f"max_calls must be >= 0, got {self.max_calls}")
        if not 1.0 <= self.ice_timeout_s <= 600.0:
            raise WebRTCConfigError(f"ice_timeout_s must be in [1, 600], got {self.ice_timeout_s}")
        if not 0 <= self.prebuffer_ms <= 1000:
            raise WebRTCConfigError(f"prebuffer_ms must be in [0, 1000], got {self.prebuffer_ms}")
        if self.turn_ttl_s < 60:
            raise WebRTCConfigError(f"turn_ttl_s must be >= 60, got {self.turn_ttl_s}")
        for s in self.ice_servers:
            if not s.turn:
                continue
            if self.turn_secret and s.static_credential:
                raise WebRTCConfigError(f"TURN server {s.urls[0]!r}: with a TURN secret its credentials are "
                                        "time-limited ones; give it no username and credential")
            if not self.turn_secret and not (s.username and s.credential):
                raise WebRTCConfigError(f"TURN server {s.urls[0]!r} needs a username and a credential, or set a "
                                        "TURN secret (MOSS_TURN_SECRET) for time-limited ones")

    def ice_servers_now(self, now: float | None = None) -> tuple[IceServer, ...]:
        """The ICE servers as a client (or the server's own peer) gets them now: TURN servers with fresh
        time-limited credentials where a TURN secret is set."""
        if not self.turn_secret:
            return self.ice_servers
        username, credential = turn_rest_credential(self.turn_secret, int(now or time.time()) + self.turn_ttl_s)
        return tuple(replace(s, username=username, credential=credential) if s.turn else s for s in self.ice_servers)

    def rtc_configuration(self) -> RTCConfiguration:
        # An explicit list even when empty: aiortc falls back to a public Google STUN server otherwise.
        return RTCConfiguration(iceServers=[RTCIceServer(urls=list(s.urls), username=s.username,
                                                         credential=s.credential) for s in self.ice_servers_now()])

    @classmethod
    def from_settings(cls, settings: Any) -> WebRTCConfig:
        """Read the server settings' WebRTC fields (absent fields keep the defaults above)."""
        d = cls()
        web_root = getattr(settings, "web_root", None)
        return cls(
            ice_servers=parse_ice_servers(getattr(settings, "ice_servers", None)),
            max_calls=int(getattr(settings, "max_calls", d.max_calls)),
            ice_timeout_s=float(getattr(settings, "ice_timeout_s", d.ice_timeout_s)),
            prebuffer_ms=int(getattr(settings, "webrtc_prebuffer_ms", d.prebuffer_ms)),
            web_root=Path(web_root) if web_root else d.web_root,
            turn_secret=getattr(settings, "turn_secret", None) or None,
            turn_ttl_s=int(getattr(settings, "turn_ttl_s", d.turn_ttl_s)),
        )
