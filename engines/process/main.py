"""The engine process: owns the GPU, serves session messages over a ZeroMQ ROUTER socket.

    python -m engines.process.main --model tiny-random|PATH --codec tiny-random|PATH \\
        --device cpu|cuda[:N] --endpoint ipc:///tmp/moss.sock|tcp://127.0.0.1:PORT \\
        [--vocoder bigvgan|hift] [--ready-file PATH]

The command line (options.py) becomes a ProcessConfig (config.py), which builds the Service (loading.py); the serving
loop (loop.py) runs it until SIGTERM or SIGINT. Options that do not go together end the process with status 2 and a
usage message; a model or codec that cannot be loaded, with status 2 and `cannot start the engine: ...`.

Readiness: the model, tokenizer and codec are loaded BEFORE the socket is bound, so the first
`Pong` means "ready" (a Ping sent earlier waits in the client's queue until then). Also, once
bound, the process logs `engine ready endpoint=...` on stderr and, with `--ready-file`, writes
that file (JSON: pid, endpoint, model, codec, device).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from engines.config import ConfigError
from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from engines.process.loop import EngineServer
from engines.process.observe.gpu_window import GpuWindow
from engines.process.options import parser

log = logging.getLogger("engines.process")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        config = ProcessConfig.from_args(args)
    except ConfigError as e:
        p.error(str(e))
    window = GpuWindow(config.gpu_window) if config.gpu_window is not None else None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s")
    try:
        service = build_service(config)
    except (ConfigError, OSError) as e:
        log.error("cannot start the engine: %s", e)
        return 2
    server = EngineServer(service, config.endpoint, client_timeout_s=config.client_timeout_s, window=window)

    def stop(signum: int, _frame: Any) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # `kill -USR1 <engine pid>` writes every thread's stack to stderr from the signal handler itself, so it works
    # even when a thread is stuck in C code holding the GIL (where the stall watch cannot sample).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if config.ready_file:
        Path(config.ready_file).write_text(json.dumps({"pid": os.getpid(), "endpoint": config.endpoint,
                                                       "model": config.model, "codec": config.codec,
                                                       "device": config.device}))
    log.info("engine ready endpoint=%s", config.endpoint)
    try:
        server.serve_forever()
    except Exception:  # noqa: BLE001 - logged in run_once; the supervisor restarts us
        return 1
    finally:
        server.close()
    log.info("engine stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
