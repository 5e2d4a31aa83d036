"""FastAPI application factory: engine supervision, sessions, routes.

`create_app(settings)` returns an app whose lifespan starts (or connects to) the engine process and
waits until it answers, and on shutdown closes sessions and stops the engine. Graceful drain on
SIGTERM is done by `server.serving.DrainingServer` before uvicorn closes connections.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from server.engine_client import EngineClient, engine_command
from server.metrics import Metrics
from server.routes import ops, realtime_ws
from server.session import SessionLimits
from server.session_manager import SessionManager
from server.settings import Settings
from server.webrtc import routes as webrtc_routes

log = logging.getLogger("server.app")


class _VadStreams:
    """Each session's VAD stream, all from one batcher per app (torch imported at the first session)."""

    def __init__(self) -> None:
        self._batcher: Any = None
        self._lock = threading.Lock()  # sessions open in worker threads

    def __call__(self) -> Any:
        with self._lock:
            if self._batcher is None:
                from server.vad import VadBatcher

                self._batcher = VadBatcher()
        return self._batcher.stream()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    endpoint = settings.resolved_endpoint()
    command = None
    if settings.spawn_engine:
        command = list(settings.engine_command) if settings.engine_command else engine_command(
            settings.model, settings.codec, settings.device, endpoint, settings.vocoder)
        if settings.engine_command:
            command += ["--endpoint", endpoint]
    engine = EngineClient(
        endpoint, command, ready_timeout_s=settings.engine_ready_timeout_s,
        ping_interval_s=settings.engine_ping_interval_s, ping_timeout_s=settings.engine_ping_timeout_s,
        on_stats=metrics.engine_stats, on_lost=metrics.engine_restarts.inc)
    limits = SessionLimits(max_message_bytes=settings.max_message_bytes,
                           max_input_buffer_seconds=settings.max_input_buffer_seconds,
                           output_queue_size=settings.output_queue_size)
    sessions = SessionManager(engine, max_sessions=settings.max_sessions, limits=limits, model=settings.model_name,
                              vad_factory=_VadStreams() if settings.vad else None, observer=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.model == "tiny-random":
            log.warning("serving RANDOM weights (tiny-random): answers are noise; pass --model/--codec for real ones")
        await engine.start()
        try:
            yield
        finally:
            await sessions.drain(0.0)
            await engine.stop()

    app = FastAPI(title="moss-speech-server", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.sessions = sessions
    app.include_router(ops.router)
    app.include_router(realtime_ws.router)
    webrtc_routes.install(app, settings, sessions)  # POST /v1/realtime/calls, /v1/info, the page at /
    return app
