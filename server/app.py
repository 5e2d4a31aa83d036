"""FastAPI application factory: engine supervision, sessions, routes.

`create_app(settings)` returns an app whose lifespan starts (or connects to) the engine process and
waits until it answers, and on shutdown closes sessions and stops the engine. Graceful drain on
SIGTERM is done by `server.serving.DrainingServer` before uvicorn closes connections. With a
`WorkerContext` (server/workers/) the app is one of several worker processes: it connects to the
supervisor's engine, admits sessions under the server-wide limit, and relays calls held by siblings (as Ray's front end
replicas do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from engines.process.options import MAX_TEXT_CHARS
from server import client_secrets
from server.engine_client import EngineClient, engine_command
from server.engine_options import engine_argv
from server.engine_pool import EnginePool, stats_callback
from server.limits import CPU_MAX_SESSIONS, size_from_engines
from server.ops import routes as ops
from server.ops.metrics import Metrics
from server.session.manager import SessionManager
from server.session.session import SessionLimits
from server.settings import Settings, gpu_count
from server.transports import ws as realtime_ws
from server.transports.relay import CallRelay, Siblings
from server.transports.webrtc import routes as webrtc_routes
from server.vad_streams import VadStreams
from server.workers.context import WorkerContext
from server.workers.slots import SharedSlots

log = logging.getLogger("server.app")


def engine_client(settings: Settings, endpoint: str, device: str | None = None, **callbacks: Any) -> EngineClient:
    """The link to the engine at `endpoint`: it spawns and supervises the engine (on `device`, else the settings')
    when settings say so, with the engine options the settings give (after the engine command's own arguments,
    when the settings replace it)."""
    command = None
    if settings.spawn_engine:
        if settings.engine_command:
            command = [*settings.engine_command, "--endpoint", endpoint]
            if device is not None:
                command += ["--device", device]
        else:
            command = engine_command(settings.model, settings.codec, device or settings.device, endpoint,
                                     settings.vocoder)
        command += engine_argv(settings)
    return EngineClient(endpoint, command, ready_timeout_s=settings.engine_ready_timeout_s,
                        ping_interval_s=settings.engine_ping_interval_s,
                        ping_timeout_s=settings.engine_ping_timeout_s, **callbacks)


def local_engines(settings: Settings, metrics: Metrics, worker: WorkerContext | None) -> EnginePool:
    """The engine this server runs (or connects to), or with --gpus one per GPU, each on a private socket."""
    pool = EnginePool()
    # Every worker sees each engine loss; one of them counts it.
    on_lost = metrics.engine_restarts.inc if worker is None or worker.index == 0 else None
    generation = worker.engine_generation_now if worker is not None and worker.engine_generation is not None else None
    devices = settings.engine_devices(gpu_count() if settings.gpus is not None else 0)
    for i, device in enumerate(devices):
        name = str(i)
        pool.engines[name] = engine_client(
            settings, settings.resolved_endpoint(), device if settings.gpus is not None else None, name=name,
            on_stats=stats_callback(metrics, lambda: pool, name), on_lost=on_lost, generation=generation)
    return pool


GAUGE_REFRESH_S = 1.0  # under --workers: how stale another worker's share of a gauge may be at a scrape


def create_app(settings: Settings | None = None, worker: WorkerContext | None = None,
               engines: Callable[[Metrics], EnginePool] | None = None, siblings: Siblings | None = None,
               own_process: bool = False) -> FastAPI:
    """`engines`: the engines to place sessions on, given the app's metrics (Ray Serve's replicas); default: the
    engine (or with --gpus the engines) this server runs. `siblings`: the other processes serving calls, where
    the calls this one does not hold are relayed (default: a worker's sibling workers). `own_process`: the app is
    its process's only work (`serve`, a worker, a Ray front end), so its VAD sets the process's torch and BLAS
    thread pools to one thread (server/vad.py, `one_thread_pools`) when it loads."""
    settings = settings or Settings()
    metrics = Metrics()
    engine = engines(metrics) if engines is not None else local_engines(settings, metrics, worker)
    limits = SessionLimits(max_message_bytes=settings.max_message_bytes,
                           max_input_buffer_seconds=settings.max_input_buffer_seconds,
                           output_queue_size=settings.output_queue_size, idle_timeout_s=settings.idle_timeout_s,
                           max_answer_rows=settings.max_answer_rows,
                           max_text_chars=int(settings.max_text_chars or MAX_TEXT_CHARS))
    # Unset, the limit is sized from the engine once it is ready; until then no session is admitted anyway.
    max_sessions = settings.max_sessions or CPU_MAX_SESSIONS
    slots = None if worker is None else SharedSlots(worker.session_counts, worker.index, max_sessions,
                                                    worker.slots_lock_path)
    vad_streams = VadStreams(settings, metrics, own_process) if settings.vad else None
    sessions = SessionManager(engine, max_sessions=max_sessions, limits=limits, model=settings.model_name,
                              vad_factory=vad_streams, observer=metrics, slots=slots)
    siblings = siblings if siblings is not None else worker
    relay = CallRelay(siblings) if siblings is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.model == "tiny-random":
            log.warning("serving RANDOM weights (tiny-random): answers are noise; pass --model/--codec for real ones")
        await asyncio.gather(engine.start(), *([vad_streams.preload()] if vad_streams is not None else []))
        if settings.max_sessions is None:  # (a worker's supervisor sets it for its workers when it runs the engine)

            def resize() -> None:
                sessions.slots.set_limit(engine.session_limit(lambda st: size_from_engines(st, settings.workers, log)))

            resize()
            engine.on_change = resize  # Ray's engine replicas come and go
        refresher = asyncio.create_task(_refresh_gauges(app)) if worker is not None else None
        try:
            yield
        finally:
            if refresher is not None:
                refresher.cancel()
            await sessions.drain(0.0)
            await engine.stop()
            if relay is not None:
                await relay.aclose()
            if slots is not None:
                slots.close()

    app = FastAPI(title="moss-speech-server", lifespan=lifespan)
    app.state.settings = settings
    app.state.client_secret_ok = None  # server.auth.ClientSecretCheck, set where client secrets are issued
    app.state.metrics = metrics
    app.state.engines = engine
    app.state.sessions = sessions
    app.state.vad_streams = vad_streams
    app.state.worker = worker
    app.state.relay = relay
    app.include_router(ops.router)
    app.include_router(realtime_ws.router)
    webrtc_routes.install(app, settings, sessions)  # POST /v1/realtime/calls, /v1/info, the page at /
    client_secrets.install(app, settings)  # POST /v1/realtime/client_secrets
    return app


async def _refresh_gauges(app: FastAPI) -> None:
    """A scrape reaches one worker; the others' shares of the gauges are kept fresh by this."""
    while True:
        ops.refresh_gauges(app.state)
        await asyncio.sleep(GAUGE_REFRESH_S)
