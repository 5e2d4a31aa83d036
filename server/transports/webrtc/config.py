"""WebRTC settings: ICE (STUN/TURN) servers, call limit, timeouts, the outbound jitter buffer, the page folder.

ICE servers use the browser's `RTCIceServer` JSON shape, so the same list configures aiortc and is handed to
the page (`GET /v1/info`), e.g.
  [{"urls": "stun:stun.example.org:3478"},
   {"urls": ["turn:turn.example.org:3478?transport=udp"], "username": "u", "credential": "p"}]
An empty list (the default) means host candidates only: enough for localhost and a LAN.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from aiortc import RTCConfiguration, RTCIceServer

# The page's package data where it is installed (a checkout's own folder under an editable install). Installed
# packages are folders on disk, so the resource is a real path, as StaticFiles needs.
DEFAULT_WEB_ROOT = Path(str(resources.files("client_web")))
_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")


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
            if u.startswith(("turn:", "turns:")) and (not self.username or not self.credential):
                raise WebRTCConfigError(f"TURN server {u!r} needs a username and a credential")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"urls": list(self.urls)}
        if self.username is not None:
            d["username"] = self.username
        if self.credential is not None:
            d["credential"] = self.credential
        return d


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

    def __post_init__(self) -> None:
        if self.max_calls < 0:
            raise WebRTCConfigError(f"max_calls must be >= 0, got {self.max_calls}")
        if not 1.0 <= self.ice_timeout_s <= 600.0:
            raise WebRTCConfigError(f"ice_timeout_s must be in [1, 600], got {self.ice_timeout_s}")
        if not 0 <= self.prebuffer_ms <= 1000:
            raise WebRTCConfigError(f"prebuffer_ms must be in [0, 1000], got {self.prebuffer_ms}")

    def rtc_configuration(self) -> RTCConfiguration:
        # An explicit list even when empty: aiortc falls back to a public Google STUN server otherwise.
        return RTCConfiguration(iceServers=[RTCIceServer(urls=list(s.urls), username=s.username,
                                                         credential=s.credential) for s in self.ice_servers])

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
        )
