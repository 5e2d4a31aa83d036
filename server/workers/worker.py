"""One worker process: the usual app on the shared listening socket plus a private unix socket.

Started by the supervisor (multiprocessing, spawn) with the settings, its WorkerContext and the
listening socket the supervisor bound. The private socket is where sibling workers relay a call's
requests (server/transports/relay.py). SIGTERM drains like a single server (server/serving.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Any

from server.workers.context import WorkerContext


def private_socket(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by this index's previous process
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    # Not listening yet: asyncio listens when uvicorn starts serving, after the app's start-up, so until
    # then a sibling's relay is refused at once (404) instead of waiting on an accept that never comes.
    return sock


def run_worker(settings_data: dict[str, Any], ctx: WorkerContext, listener: socket.socket) -> None:
    from server.app import create_app
    from server.engine_client import die_with_parent
    from server.ops.logs import setup_logging
    from server.serving import DrainingServer, raise_open_file_limit, uvicorn_config
    from server.settings import Settings

    die_with_parent()
    os.setpgrp()  # a terminal's Ctrl-C reaches the supervisor alone; it sends each worker one SIGTERM
    settings = Settings(**settings_data)
    setup_logging(settings.log_level, settings.log_format, worker=ctx.index, secrets=settings.secrets())
    app = create_app(settings, worker=ctx, own_process=True)
    raise_open_file_limit(settings.max_connections)
    server = DrainingServer(uvicorn_config(app, settings.host, settings.port, settings.log_level))
    server.run(sockets=[listener, private_socket(ctx.socket_path(ctx.index))])
    sys.exit(0 if server.started else 1)
