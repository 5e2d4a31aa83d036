"""A real server (uvicorn on 127.0.0.1, port chosen by the OS) in a background thread, for tests."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from typing import Any

import httpx
import websockets

from server.app import create_app
from server.serving import DrainingServer, uvicorn_config
from server.settings import Settings
from server.workers.context import WorkerContext

FAKE_ENGINE = [sys.executable, "-m", "tests.fakes.fake_engine", "--model", "x", "--codec", "x", "--device", "cpu"]


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for a server started in another process)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    """`worker`: run the app as that worker of a --workers server (its own port here, plus its private socket).
    `peers`: run it as one of several Ray front end replicas (server.cluster.peers.FrontendPeers: its relay port)."""

    def __init__(self, settings: Settings, worker: WorkerContext | None = None, peers: Any = None) -> None:
        self.app = create_app(settings, worker, siblings=peers)
        if peers is not None:
            peers.attach(self.app)
        self.server = DrainingServer(uvicorn_config(self.app, "127.0.0.1", 0, "warning"))
        sockets = None
        if worker is not None:
            from server.workers.supervisor import bind_listener
            from server.workers.worker import private_socket

            sockets = [bind_listener("127.0.0.1", 0), private_socket(worker.socket_path(worker.index))]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets}, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}/v1/realtime"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def health(self) -> httpx.Response:
        return httpx.get(self.http + "/health", timeout=10)

    def engine_stats(self) -> dict[str, Any]:
        """The engine's stats from its last Pong (one ping interval old at most)."""
        return self.health().json()["engine"]

    def engine(self, name: str = "0") -> Any:
        """The server's link to one of its engines (server.engine_client.EngineClient)."""
        return self.app.state.engines.engines[name]

    def engine_stats_now(self, timeout: float = 60.0, name: str = "0") -> dict[str, Any]:
        """The engine's stats from a Pong to a Ping sent now, on the server's engine socket: the engine has handled
        every message the server sent it before (one socket, in order)."""
        engine = self.engine(name)
        ping = engine._ping(engine._sock, timeout)
        pong = asyncio.run_coroutine_threadsafe(ping, engine._recv_task.get_loop()).result(timeout + 10)
        assert pong is not None, f"the engine did not answer a ping within {timeout} s"
        return dict(pong.stats)

    async def wait_engine_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no request runs, no session is open and every KV block is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.engine_stats()
            if (st["running"] == 0 and st["sessions"] == 0 and st["kv_free"] == st["kv_total"]) \
                    or time.monotonic() > deadline:
                return st
            await asyncio.sleep(0.1)

    def wait_engine(self, ready: bool = True, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.health()
            if (r.status_code == 200) == ready:
                return r.json()
            time.sleep(0.1)
        raise AssertionError(f"engine ready={ready} not reached in {timeout} s: {self.health().json()}")


def fake_settings(**kw: Any) -> Settings:
    base: dict[str, Any] = {"engine_command": FAKE_ENGINE, "engine_ping_interval_s": 0.2,
                            "engine_ping_timeout_s": 5.0, "engine_ready_timeout_s": 60.0, "drain_timeout_s": 2.0}
    base.update(kw)
    return Settings(**base)


def tiny_settings(**kw: Any) -> Settings:
    """The real engine process on the CPU with the tiny random model and codec (slow steps: long ping timeout)."""
    base: dict[str, Any] = {"model": "tiny-random", "codec": "tiny-random", "device": "cpu",
                            "engine_ping_interval_s": 0.25, "engine_ping_timeout_s": 60.0,
                            "engine_ready_timeout_s": 300.0}
    base.update(kw)
    return Settings(**base)


async def recv_event(ws: Any, timeout: float = 30.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_until(ws: Any, etype: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """All events up to and including the first of type `etype`."""
    out = []
    deadline = time.monotonic() + timeout
    while True:
        ev = await recv_event(ws, max(0.01, deadline - time.monotonic()))
        out.append(ev)
        if ev["type"] == etype:
            return out


async def events_until_closed(ws: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Every event until the server closes the socket (no event for `timeout` seconds fails the caller)."""
    events = []
    try:
        while True:
            events.append(await recv_event(ws, timeout))
    except websockets.ConnectionClosed:
        return events


async def send(ws: Any, etype: str, **fields: Any) -> None:
    await ws.send(json.dumps({"type": etype, **fields}))


async def user_text(ws: Any, text: str) -> None:
    await send(ws, "conversation.item.create",
               item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})


async def start_answer(ws: Any, text: str, **response: Any) -> list[dict[str, Any]]:
    """A text turn and a response; returns the events up to the first audio delta."""
    await user_text(ws, text)
    await send(ws, "response.create", **({"response": response} if response else {}))
    return await recv_until(ws, "response.output_audio.delta", timeout=180)
