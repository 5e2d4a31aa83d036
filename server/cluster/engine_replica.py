"""An engine as a Ray Serve replica: one engine process on the replica's GPU, reached by front ends over ZeroMQ.

The replica starts the engine (engines.process.main) on a TCP port of its node, waits until it answers, and renews
its entry in the EngineDirectory while the engine is up. Ray Serve's health check fails once the engine has been
lost, and Ray replaces the replica (and with it the engine: a child that dies with its parent); the front ends end
the lost engine's sessions (`engine_unavailable`) when its entry expires or its pings go unanswered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import asdict
from typing import Any

import ray
from ray import serve

from server.app import engine_client
from server.cluster.directory import HEARTBEAT_S, EngineEntry
from server.limits import session_limit
from server.settings import Settings

log = logging.getLogger("server.cluster")


def free_tcp_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EngineReplica:
    async def __init__(self, directory: Any, settings: dict[str, Any], drain_s: float) -> None:
        self.settings = Settings(**settings)
        self.directory = directory
        self.drain_s = drain_s
        node = ray.util.get_node_ip_address()
        endpoint = f"tcp://{node}:{free_tcp_port(node)}"
        # Ray gives a replica with num_gpus its GPU as the only visible one.
        device = self.settings.device if self.settings.device != "auto" else ("cuda" if ray.get_gpu_ids() else "cpu")
        self.engine = engine_client(self.settings, endpoint, device)
        await self.engine.start()  # a failure fails the replica's start: Ray tries again
        self.entry = EngineEntry(replica=serve.get_replica_context().replica_id.unique_id, endpoint=endpoint,
                                 pid=os.getpid(), node=node)
        await self.directory.heartbeat.remote(asdict(self.entry))
        self._heartbeat = asyncio.create_task(self._renew())
        log.info("engine replica %s ready at %s on %s", self.entry.replica, endpoint, device)

    def _up(self) -> bool:
        return self.engine.ready and self.engine.restarts == 0

    async def _renew(self) -> None:
        while self._up():
            # A call waits for a directory replica: while it restarts (or once the application is being deleted)
            # there is none, and the next beat goes on.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call(self.directory.heartbeat, asdict(self.entry)), HEARTBEAT_S)
            await asyncio.sleep(HEARTBEAT_S)

    @staticmethod
    async def _call(method: Any, *args: Any) -> Any:
        return await method.remote(*args)

    async def check_health(self) -> None:
        """Ray Serve's health check: an engine that was lost fails it, and Ray replaces this replica."""
        if not self._up():
            raise RuntimeError(f"engine at {self.entry.endpoint} lost (restarts {self.engine.restarts})")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """For server.cluster.autoscale: the sessions open on this engine, and how many it holds."""
        stats = self.engine.stats
        return {"sessions": float(stats.get("sessions", 0)), "capacity": float(session_limit(stats).sessions)}

    async def describe(self) -> dict[str, Any]:
        return {**asdict(self.entry), "stats": self.engine.stats}

    async def __del__(self) -> None:
        """Scaled down or shut down: leave the directory (no new sessions), let the sessions on the engine end (up
        to drain_s), then stop it."""
        self._heartbeat.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._call(self.directory.leave, self.entry.replica), HEARTBEAT_S)
        deadline = time.monotonic() + self.drain_s
        while self._up() and self.engine.stats.get("sessions", 0) and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        await self.engine.stop()
