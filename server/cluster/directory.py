"""Where the engine replicas and the front end replicas are: each engine's ZeroMQ endpoint, so that a front end
talks to it directly, and each front end's relay address, so that a front end reaches the one holding a call.

Ray Serve routes a call on a deployment handle to any replica; a session must stay on one engine (its history is in
that engine's KV cache) and its messages must not ride Ray's RPC (a frame every few ms per session). So each engine
replica says where its engine listens here, again every HEARTBEAT_S, and front ends connect to it themselves. Ray's
ingress likewise sends a WebRTC call's requests to any front end: with several, each says here where it takes the
requests relayed by its siblings (server/cluster/peers.py). An entry not renewed for EXPIRE_S is dropped: the replica
is gone (a restarted one comes back under a new id).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Generic, TypeVar

HEARTBEAT_S = 1.0
EXPIRE_S = 4.0


@dataclass(frozen=True)
class EngineEntry:
    replica: str  # Ray Serve's replica id: the engine's label in /health and /metrics
    endpoint: str  # tcp://NODE_IP:PORT of its engine process
    pid: int  # the replica's process (its engine process dies with it)
    node: str  # the node's IP


@dataclass(frozen=True)
class FrontendEntry:
    tag: str  # in the ids of the calls it answers (server/cluster/peers.py)
    host: str  # its relay port's address: the node's IP
    port: int
    replica: str  # Ray Serve's replica id, for logs


E = TypeVar("E", EngineEntry, FrontendEntry)


class _Renewed(Generic[E]):
    """Entries by key, each dropped once not renewed for EXPIRE_S."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[E, float]] = {}

    def renew(self, key: str, entry: E) -> None:
        self._entries[key] = (entry, time.monotonic())

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def live(self) -> dict[str, E]:
        now = time.monotonic()
        self._entries = {k: v for k, v in self._entries.items() if now - v[1] <= EXPIRE_S}
        return {k: e for k, (e, _) in self._entries.items()}


class EngineDirectory:
    """A Ray Serve deployment of one replica (the state is soft: replicas renew it, so a restart loses nothing)."""

    def __init__(self) -> None:
        self._engines: _Renewed[EngineEntry] = _Renewed()
        self._frontends: _Renewed[FrontendEntry] = _Renewed()

    def heartbeat(self, entry: dict) -> None:
        e = EngineEntry(**entry)
        self._engines.renew(e.replica, e)

    def leave(self, replica: str) -> None:
        self._engines.drop(replica)

    def engines(self) -> list[dict]:
        """The engines heard from in the last EXPIRE_S."""
        return [asdict(e) for e in self._engines.live().values()]

    def frontend_heartbeat(self, entry: dict) -> None:
        e = FrontendEntry(**entry)
        self._frontends.renew(e.tag, e)

    def frontend_leave(self, tag: str) -> None:
        self._frontends.drop(tag)

    def frontend(self, tag: str) -> dict | None:
        """The front end whose call ids carry `tag`, if heard from in the last EXPIRE_S."""
        e = self._frontends.live().get(tag)
        return None if e is None else asdict(e)

    def frontends(self) -> list[dict]:
        return [asdict(e) for e in self._frontends.live().values()]
