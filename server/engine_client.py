"""The server's side of the engine process: spawn, readiness, supervision, and message routing.

The engine binds a ZeroMQ ROUTER on `endpoint`; each server process connects one DEALER, so several
servers (or uvicorn workers) can share one engine. Frames are msgpack messages of
engines.protocol.messages. Incoming messages go to the session named by their `session_id`.

Supervision: a Ping every `ping_interval_s`; if the spawned process exits, or no Pong arrives for
`ping_timeout_s`, the engine is declared lost: every registered session gets `on_engine_lost()` (it
emits an `error` event and ends), the process is killed if still there, and a new one is started with
backoff. A fresh DEALER is used for every engine generation so no stale frames reach the new engine.
With `spawn=False` the server only connects to an engine someone else runs (and supervises). When
that someone is this server's own supervisor (`--workers`), it bumps a shared generation count on every
engine it loses, and each worker ends its sessions within a ping interval instead of waiting for the
pings to time out (a fast restart would otherwise answer them, and the new engine knows no session).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from engines.protocol import messages as m

log = logging.getLogger("server.engine")


class EngineStartError(RuntimeError):
    pass


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    # An engine (or a server worker) must not outlive a server that was SIGKILLed (it would hold the GPU).
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch  # only to pick the device; the server never touches tensors

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_command(model: str, codec: str, device: str, endpoint: str, vocoder: str | None = None) -> list[str]:
    device = resolve_device(device)
    return [sys.executable, "-m", "engines.process.main", "--model", model, "--codec", codec,
            "--device", device, "--endpoint", endpoint, *(["--vocoder", vocoder] if vocoder else [])]


class EngineClient:
    def __init__(
        self,
        endpoint: str,
        command: list[str] | None,
        *,
        ready_timeout_s: float = 300.0,
        ping_interval_s: float = 1.0,
        ping_timeout_s: float = 30.0,
        restart_backoff_s: float = 0.5,
        on_stats: Callable[[dict[str, Any]], None] | None = None,
        on_lost: Callable[[], None] | None = None,
        generation: Callable[[], int] | None = None,
        name: str = "0",
    ) -> None:
        self.name = name  # the label of this engine in /health and /metrics
        self.endpoint = endpoint
        self.command = command  # None: connect to an engine run elsewhere
        self.ready_timeout_s = ready_timeout_s
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self._on_stats = on_stats
        self._on_lost = on_lost
        self._generation = generation  # the supervisor's count of engines lost, when it runs the engine
        self._seen_generation = generation() if generation is not None else 0
        self.ready = False
        self.stats: dict[str, Any] = {}
        self.restarts = 0
        self.proc: asyncio.subprocess.Process | None = None
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._sessions: dict[str, Any] = {}
        self._nonce = 0
        self._last_pong = 0.0
        self._pong_waiters: dict[int, asyncio.Future[m.Pong]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._recv_task: asyncio.Task[Any] | None = None
        self._stopping = False

    # ---- sessions ----------------------------------------------------------------------------

    def register(self, session_id: str, session: Any) -> None:
        self._sessions[session_id] = session

    def unregister(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    @property
    def placed(self) -> int:
        """Sessions open on this engine."""
        return len(self._sessions)

    def end_sessions(self) -> None:
        """The engine is gone with their history: every session on it ends with engine_unavailable."""
        for session in list(self._sessions.values()):
            try:
                session.on_engine_lost()
            except Exception:  # noqa: BLE001
                log.exception("session failed to handle engine loss")
        self._sessions.clear()

    async def send(self, msg: Any) -> None:
        sock = self._sock
        if sock is None or not self.ready:
            log.debug("engine not ready, dropped %s", type(msg).__name__)
            return
        try:
            await sock.send(m.encode(msg))
        except zmq.ZMQError as e:  # the socket was closed under us: the engine is being replaced
            log.debug("send of %s failed: %s", type(msg).__name__, e)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start (or connect to) the engine and wait until it answers; then supervise it."""
        await self._start_generation()
        self._tasks.append(asyncio.create_task(self._supervise(), name="engine-supervisor"))

    async def stop(self) -> None:
        self._stopping = True
        self.ready = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        await self._close_socket()
        await self._kill_process()
        self._ctx.term()

    async def _start_generation(self) -> None:
        if self.command is not None:
            log.info("starting engine: %s", " ".join(self.command))
            # A session of its own: a terminal's Ctrl-C reaches the server, which drains answers and then stops
            # the engine; the engine stopping at the same signal would fail the answers the drain waits for.
            self.proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._sock = sock
        self._recv_task = asyncio.create_task(self._recv_loop(sock), name="engine-recv")
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc is not None and self.proc.returncode is not None:
                await self._close_socket()
                raise EngineStartError(f"engine process exited with code {self.proc.returncode} while loading")
            if time.monotonic() > deadline:
                await self._close_socket()
                await self._kill_process()
                raise EngineStartError(f"engine did not answer within {self.ready_timeout_s:g} s at {self.endpoint}")
            pong = await self._ping(sock, timeout=0.25)
            if pong is not None:
                break
        self._last_pong = time.monotonic()
        if self._generation is not None:  # the engines the supervisor lost so far include any before this one
            self._seen_generation = self._generation()
        self.ready = True
        log.info("engine ready pid=%s endpoint=%s stats=%s", self.proc.pid if self.proc else None, self.endpoint,
                 self.stats)

    async def _ping(self, sock: zmq.asyncio.Socket, timeout: float) -> m.Pong | None:
        self._nonce += 1
        nonce = self._nonce
        fut: asyncio.Future[m.Pong] = asyncio.get_running_loop().create_future()
        self._pong_waiters[nonce] = fut
        try:
            await sock.send(m.encode(m.Ping(nonce=nonce)))
            return await asyncio.wait_for(fut, timeout)
        except (TimeoutError, zmq.ZMQError):
            return None
        finally:
            self._pong_waiters.pop(nonce, None)

    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                msg = m.decode(frames[-1])
            except m.MessageError as e:
                log.warning("%s", e)
                continue
            if isinstance(msg, m.Pong):
                self._last_pong = time.monotonic()
                self.stats = dict(msg.stats)
                if self._on_stats is not None:
                    self._on_stats(self.stats)
                fut = self._pong_waiters.get(msg.nonce)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            sid = getattr(msg, "session_id", None)
            session = self._sessions.get(sid) if sid is not None else None
            if session is None:
                if isinstance(msg, m.Error):
                    log.warning("engine error session_id=%s code=%s message=%s", sid, msg.code, msg.message)
                continue
            try:
                session.on_engine_message(msg)
            except Exception:  # noqa: BLE001 - one broken session must not stop routing for the others
                log.exception("session_id=%s failed to handle %s", sid, type(msg).__name__)

    async def _supervise(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.ping_interval_s)
            if self._sock is None:
                continue
            if self._generation is not None and self._generation() != self._seen_generation:
                await self._engine_lost("restarted by the server's supervisor")
                continue
            died = self.proc is not None and self.proc.returncode is not None
            if not died:
                await self._ping(self._sock, timeout=min(self.ping_interval_s, 1.0))
                died = self.proc is not None and self.proc.returncode is not None
            silent = time.monotonic() - self._last_pong > self.ping_timeout_s
            if died or silent:
                why = f"exited with code {self.proc.returncode}" if died and self.proc else "stopped answering"
                await self._engine_lost(why)

    async def _engine_lost(self, why: str) -> None:
        log.error("engine lost (%s): ending %d session(s) and restarting engine=%s", why, self.placed, self.name)
        self.ready = False
        self.end_sessions()
        if self._on_lost is not None:
            self._on_lost()
        await self._close_socket()
        await self._kill_process()
        backoff = self.restart_backoff_s
        while not self._stopping:
            try:
                await self._start_generation()
                self.restarts += 1
                return
            except EngineStartError as e:
                log.error("engine restart failed: %s; retrying in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _close_socket(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._recv_task
            self._recv_task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _kill_process(self) -> None:
        p = self.proc
        if p is None or self.command is None:
            return
        if p.returncode is None:
            p.terminate()
            try:
                await asyncio.wait_for(p.wait(), 10)
            except TimeoutError:
                p.kill()
                await p.wait()
        self.proc = None
