"""The supervisor of `moss-speech serve --workers N`: one port, one engine, N worker processes.

It binds the listening socket once (the workers accept on it, so the kernel spreads connections),
starts and supervises the engine like a single server does, and starts the workers with spawn (no
state forked from this process). It keeps them running:

- a worker that exits is started again (1 s, doubling to 30 s while it keeps dying within 10 s); its
  share of the session count is zeroed and its live gauges dropped. Its sessions in the engine are
  closed by the engine once the worker's socket has been silent for the engine's client timeout;
- an engine that is lost is restarted, and the shared generation count makes every worker end its
  sessions at its next ping instead of at its ping timeout;
- the first SIGTERM/SIGINT is passed to every worker as SIGTERM (each drains like a single server);
  a second one is passed on too (the workers stop waiting). The engine stops after the last worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess

from server.app import engine_client
from server.limits import size_from_engine
from server.ops.metrics import MULTIPROC_ENV
from server.settings import Settings
from server.workers.context import WorkerContext
from server.workers.worker import run_worker

log = logging.getLogger("server.supervisor")

POLL_S = 0.25
RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0
SHORT_LIFE_S = 10.0  # a worker that dies sooner than this after its start backs off longer each time
STOP_GRACE_S = 15.0  # beyond drain_timeout_s, for uvicorn's own shutdown, before a worker is killed


def bind_listener(host: str, port: int) -> socket.socket:
    """The TCP socket every worker accepts on (IPv6 when the host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        if settings.workers < 2:
            raise ValueError(f"the supervisor runs 2 or more workers, got workers={settings.workers}")
        self.settings = settings
        self.n = settings.workers
        self._mp = multiprocessing.get_context("spawn")
        self.endpoint = settings.resolved_endpoint()
        self.generation = self._mp.Value("i", 0)
        self.counts = self._mp.Array("i", self.n, lock=False)  # admissions lock a file (server/workers/slots.py)
        self.socket_dir = ""
        self.metrics_dir = ""
        self.procs: list[BaseProcess | None] = [None] * self.n
        self._started_at = [0.0] * self.n
        self._backoff = [RESTART_MIN_S] * self.n
        self._restart_at = [0.0] * self.n
        self.port: int | None = None
        self.max_sessions = settings.max_sessions  # unset: sized from the engine this process starts
        self._stop: asyncio.Event | None = None

    def run(self) -> int:
        self.socket_dir = tempfile.mkdtemp(prefix="moss-speech-workers-")
        self.metrics_dir = tempfile.mkdtemp(prefix="moss-speech-metrics-")
        os.environ[MULTIPROC_ENV] = self.metrics_dir  # inherited by every worker started from here on
        try:
            return asyncio.run(self._run())
        finally:
            os.environ.pop(MULTIPROC_ENV, None)
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _worker_settings(self) -> dict:
        # Workers never spawn an engine: they connect to the one this process runs (or the operator's).
        return {**self.settings.model_dump(), "spawn_engine": False, "engine_endpoint": self.endpoint,
                "max_sessions": self.max_sessions}

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        s = self.settings
        try:
            listener = bind_listener(s.host, s.port)
        except OSError as e:
            log.error("cannot listen on %s:%d: %s", s.host, s.port, e)
            return 1
        self.port = listener.getsockname()[1]
        engine = engine_client(s, self.endpoint, on_lost=self._engine_lost) if s.spawn_engine else None
        try:
            if engine is not None and not await self._start_engine(engine):
                return 1 if not self._stop.is_set() else 0
            if engine is not None and self.max_sessions is None:  # one figure for every worker, logged once
                self.max_sessions = size_from_engine(engine.stats, self.n, log)
            log.info("serving on %s:%d with %d workers", s.host, self.port, self.n)
            while not self._stop.is_set():
                self._keep_workers(listener)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), POLL_S)
            await self._stop_workers()
        finally:
            listener.close()
            if engine is not None:
                await engine.stop()
        log.info("stopped")
        return 0

    async def _start_engine(self, engine) -> bool:  # noqa: ANN001 - server.engine_client.EngineClient
        """Wait until the engine answers (False if it cannot start, or a signal came first)."""
        assert self._stop is not None
        started = asyncio.create_task(engine.start())
        stopped = asyncio.create_task(self._stop.wait())
        await asyncio.wait({started, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not started.done():
            started.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await started
            return False
        try:
            started.result()
        except Exception as e:  # noqa: BLE001 - EngineStartError and the like: say why and exit
            log.error("the engine did not start: %s", e)
            return False
        return True

    def _engine_lost(self) -> None:
        with self.generation.get_lock():
            self.generation.value += 1

    def _on_signal(self) -> None:
        assert self._stop is not None
        self._stop.set()
        for p in self.procs:
            if p is not None and p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def _context(self, index: int) -> WorkerContext:
        generation = self.generation if self.settings.spawn_engine else None
        return WorkerContext(index, self.n, self.socket_dir, self.counts, generation)

    def _keep_workers(self, listener: socket.socket) -> None:
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if p is None:
                if now >= self._restart_at[i]:
                    self._start_worker(i, listener)
                continue
            if p.is_alive():
                continue
            p.join()
            lived = now - self._started_at[i]
            wait = self._backoff[i] if lived < SHORT_LIFE_S else RESTART_MIN_S
            self._backoff[i] = min(2 * wait, RESTART_MAX_S)
            self._restart_at[i] = now + wait
            log.error("worker %d (pid %s) exited with code %s after %.1f s; starting it again in %.0f s", i, p.pid,
                      p.exitcode, lived, wait)
            self._forget_worker(i, p.pid)
            self.procs[i] = None

    def _start_worker(self, index: int, listener: socket.socket) -> None:
        p = self._mp.Process(target=run_worker, args=(self._worker_settings(), self._context(index), listener),
                             name=f"moss-speech-worker-{index}")
        p.start()
        self.procs[index] = p
        self._started_at[index] = time.monotonic()
        log.info("worker %d started (pid %s)", index, p.pid)

    def _forget_worker(self, index: int, pid: int | None) -> None:
        self.counts[index] = 0  # its sessions died with it (no one else writes this count)
        if pid is not None:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid, self.metrics_dir)

    async def _stop_workers(self) -> None:
        deadline = time.monotonic() + self.settings.drain_timeout_s + STOP_GRACE_S
        while any(p is not None and p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            if p.is_alive():
                log.error("worker %d (pid %s) did not stop in time; killing it", i, p.pid)
                p.kill()
            p.join()
            self.procs[i] = None
