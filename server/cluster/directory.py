"""Where the engine replicas are: each one's ZeroMQ endpoint, so that a front end talks to it directly.

Ray Serve routes a call on a deployment handle to any replica; a session must stay on one engine (its history is in
that engine's KV cache) and its messages must not ride Ray's RPC (a frame every few ms per session). So each engine
replica says where its engine listens here, again every HEARTBEAT_S, and front ends connect to it themselves. An
entry not renewed for EXPIRE_S is dropped: the replica is gone (a restarted one comes back under a new id).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

HEARTBEAT_S = 1.0
EXPIRE_S = 4.0


@dataclass(frozen=True)
class EngineEntry:
    replica: str  # Ray Serve's replica id: the engine's label in /health and /metrics
    endpoint: str  # tcp://NODE_IP:PORT of its engine process
    pid: int  # the replica's process (its engine process dies with it)
    node: str  # the node's IP


class EngineDirectory:
    """A Ray Serve deployment of one replica (the state is soft: engines renew it, so a restart loses nothing)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[EngineEntry, float]] = {}

    def heartbeat(self, entry: dict) -> None:
        e = EngineEntry(**entry)
        self._entries[e.replica] = (e, time.monotonic())

    def leave(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def engines(self) -> list[dict]:
        """The engines heard from in the last EXPIRE_S."""
        now = time.monotonic()
        self._entries = {k: v for k, v in self._entries.items() if now - v[1] <= EXPIRE_S}
        return [asdict(e) for e, _ in self._entries.values()]
