"""Running the app under uvicorn with the server's limits and a graceful drain on SIGTERM/SIGINT.

On the first signal: stop accepting sessions (/health turns 503), let answers in progress finish up to
`drain_timeout_s`, close every session with an `error` event `server_shutting_down` (close 1001), wait for the
client sockets to close (uvicorn's shutdown would close any still open with 1012), then let uvicorn stop. After SIGTERM
the process exits with status 0 (the shutdown asked for happened: what a supervisor expects of a clean stop); after
Ctrl-C it ends by SIGINT, as a shell expects. A second signal skips the wait, and the process ends by that signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from server.transports.connections import RealtimeWebSocket


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    settings = app.state.settings
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, ws=RealtimeWebSocket,
                          ws_max_size=settings.max_message_bytes, ws_ping_interval=20.0, ws_ping_timeout=20.0,
                          timeout_graceful_shutdown=5, log_config=None, lifespan="on")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:  # noqa: ANN001 - uvicorn's signature
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        loop = self._loop

        def begin() -> None:
            self._drain_task = loop.create_task(self._drain_then_exit(sig, frame))

        loop.call_soon_threadsafe(begin)

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        app = self.config.app
        try:
            await app.state.sessions.drain(app.state.settings.drain_timeout_s)
        finally:
            super().handle_exit(sig, frame)
            # uvicorn raises the signals it caught again once it has stopped (the process then died by SIGTERM,
            # status -15): a drained SIGTERM is a clean exit. A second signal, caught during the drain, stays.
            if sig == signal.SIGTERM:
                with contextlib.suppress(AttributeError, ValueError):
                    self._captured_signals.remove(sig)
