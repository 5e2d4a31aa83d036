"""The realtime front end as a Ray Serve replica: the server's app (WebSocket, WebRTC signalling, VAD, sessions)
behind Ray Serve's ingress (HAProxy), placing sessions on the engine replicas listed in the EngineDirectory.

Each front end connects its own ZeroMQ socket to every engine it finds (what a session sends and receives goes that
way, not through Ray), places each new session by the same headroom rule as `--gpus`, and ends the sessions of an
engine whose entry expired. With several front ends, each relays a WebRTC call's requests to the one holding the
call (server/cluster/peers.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve

from server.app import create_app
from server.cluster.directory import HEARTBEAT_S
from server.cluster.peers import FrontendPeers
from server.engine_client import EngineClient, EngineStartError
from server.engine_pool import EnginePool, stats_callback
from server.ops.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("server.cluster")


class RayEngines(EnginePool):
    """The engine replicas the directory lists, each joined once it answers and dropped once its entry expired."""

    def __init__(self, directory: Any, settings: Settings, metrics: Metrics, frontends: int) -> None:
        super().__init__()
        self._frontends = frontends
        self._directory = directory
        self._settings = settings
        self._metrics = metrics
        self._joining: dict[str, asyncio.Task[None]] = {}
        self._sync: asyncio.Task[None] | None = None

    def session_limit(self, size: Callable[[list[dict[str, Any]]], int]) -> int:
        """This front end's share of what the engines hold: the ingress gives each front end as many sessions."""
        return max(1, math.ceil(super().session_limit(size) / self._frontends))

    async def start(self) -> None:
        """Follow the directory; return once an engine takes sessions (EngineStartError if none does in time)."""
        self._sync = asyncio.create_task(self._follow(), name="engine-directory")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.engine_ready_timeout_s
        while not self.ready:
            if loop.time() > deadline:
                raise EngineStartError(f"no engine replica answered within {self._settings.engine_ready_timeout_s:g} s")
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for t in [self._sync, *self._joining.values()]:
            if t is not None:
                t.cancel()
        await super().stop()

    async def _follow(self) -> None:
        while True:
            try:
                await self.sync(await self._directory.engines.remote())
            except Exception:  # noqa: BLE001 - the directory restarting: the engines joined so far carry on
                log.warning("the engine directory did not answer", exc_info=True)
            await asyncio.sleep(HEARTBEAT_S)

    async def sync(self, entries: list[dict[str, Any]]) -> None:
        listed = {e["replica"]: e for e in entries}
        for name in [n for n in self.engines if n not in listed]:
            if name in self._joining:
                self._joining.pop(name).cancel()
            await self.remove(name, "its replica left the directory")
        for name, entry in listed.items():
            if name not in self.engines:
                self._joining[name] = asyncio.create_task(self._join(name, entry["endpoint"]))

    async def _join(self, name: str, endpoint: str) -> None:
        s = self._settings
        client = EngineClient(endpoint, None, name=name, ready_timeout_s=s.engine_ready_timeout_s,
                              ping_interval_s=s.engine_ping_interval_s, ping_timeout_s=s.engine_ping_timeout_s,
                              on_stats=stats_callback(self._metrics, lambda: self, name),
                              on_lost=self._metrics.engine_restarts.inc)
        try:
            await self.add(client)
        except EngineStartError as e:
            log.warning("engine %s at %s did not answer: %s", name, endpoint, e)
            self.engines.pop(name, None)
            await client.stop()
        finally:
            self._joining.pop(name, None)


class Frontend:
    """Bound with the directory's handle and the engine deployment's (which puts the engines in the application), and
    the number of front end replicas (each admits its share of the sessions the engines hold)."""

    def __init__(self, directory: Any, engines: Any, settings: dict[str, Any], frontends: int) -> None:
        self.directory = directory
        self.engines = engines
        self.frontends = frontends
        # Sessions are placed on the replicas' engines: this process starts none.
        self.settings = Settings(**{**settings, "spawn_engine": False})

    def __serve_build_asgi_app__(self) -> FastAPI:
        # One front end holds every call; with more, a call's requests may reach any of them.
        peers = None
        if self.frontends > 1:
            peers = FrontendPeers(self.directory, ray.util.get_node_ip_address(),
                                  serve.get_replica_context().replica_id.unique_id)
        app = create_app(self.settings, siblings=peers,
                         engines=lambda metrics: RayEngines(self.directory, self.settings, metrics, self.frontends),
                         own_process=True)
        if peers is not None:
            peers.attach(app)
        return app


IngressFrontend = serve.ingress()(Frontend)


