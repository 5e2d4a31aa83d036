"""Running the app under uvicorn with the server's limits and a graceful drain on SIGTERM/SIGINT.

On the first signal: stop accepting sessions (/health turns 503), let answers in progress finish up to
`drain_timeout_s`, close every session with an `error` event `server_shutting_down` (close 1001), wait for the
client sockets to close (uvicorn's shutdown would close any still open with 1012), then let uvicorn stop. After SIGTERM
the process exits with status 0 (the shutdown asked for happened: what a supervisor expects of a clean stop); after
Ctrl-C it ends by SIGINT, as a shell expects. A second signal skips the wait, and the process ends by that signal.

Connection limits (docs/operations.md, "Limits and abuse"): a request head (an HTTP request's, a WebSocket upgrade's)
must arrive within `header_timeout_s` and be at most MAX_HEAD_BYTES; an idle kept-alive HTTP connection closes after
KEEP_ALIVE_S; past `max_connections` open connections, HTTP requests get 503 (WebSocket sessions are bounded by the
session limit). The open-file limit is raised to its hard limit at start: each connection is a file descriptor, and
a process out of them stops accepting (established sessions go on; it accepts again as connections close).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from server.transports.connections import RealtimeWebSocket, http_protocol

log = logging.getLogger("server.serving")

KEEP_ALIVE_S = 5  # an idle kept-alive HTTP connection is closed after this (uvicorn's default, stated)
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers larger than this get 400
LISTEN_BACKLOG = 2048  # connections the kernel holds before they are accepted


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info", *, lifespan: str = "on",
                   asgi: Any = None) -> uvicorn.Config:
    """`asgi`: what to serve in place of `app` (a filter in front of it); lifespan "off" where another server runs
    the app's start-up and shutdown."""
    settings = app.state.settings
    return uvicorn.Config(asgi or app, host=host, port=port, log_level=log_level,
                          http=http_protocol(settings.header_timeout_s),
                          ws=RealtimeWebSocket, ws_max_size=settings.max_message_bytes, ws_ping_interval=20.0,
                          ws_ping_timeout=20.0, timeout_keep_alive=KEEP_ALIVE_S,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, limit_concurrency=settings.max_connections,
                          backlog=LISTEN_BACKLOG, timeout_graceful_shutdown=5, log_config=None, lifespan=lifespan)


def raise_open_file_limit(max_connections: int) -> int:
    """Raise this process's open-file limit to its hard limit; returns it (a warning when it is below what
    `max_connections` needs)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != resource.RLIM_INFINITY and soft < max_connections + 256:
        log.warning("open-file limit %d: below max_connections %d plus the server's own files; past it new "
                    "connections wait until others close (raise it with ulimit -n)", soft, max_connections)
    return soft


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
