"""`moss-speech serve`: the realtime API (and the web page) under uvicorn, with the engine process it supervises.

Every flag has a `MOSS_*` environment variable (see server/settings.py); flags win.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from moss_speech.commands import serve_ray
from server import engine_options
from server.limits import CPU_MAX_SESSIONS, SESSION_ROWS, workers_advice


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="tiny-random (default) or a MOSS-Speech checkpoint directory [MOSS_MODEL]")
    p.add_argument("--codec", help="tiny-random (default) or a MOSS-Speech-Codec directory [MOSS_CODEC]")
    p.add_argument("--device", help="engine device: auto, cpu, cuda, cuda:N [MOSS_DEVICE]")
    p.add_argument("--gpus", help="one engine per GPU of this host: N or all (default: one engine on --device); each "
                                  "new session goes to the engine with the most headroom; with --device cpu, N engines "
                                  "on the CPU [MOSS_GPUS]")
    p.add_argument("--vocoder", choices=("bigvgan", "hift"),
                   help="codec vocoder (default: hift for a codec directory without bigvgan/, else bigvgan); "
                        "hift runs as CUDA graphs and serves far more sessions on a GPU [MOSS_VOCODER]")
    p.add_argument("--host", help="bind address (default 127.0.0.1) [MOSS_HOST]")
    p.add_argument("--port", type=int, help="port (default 8000) [MOSS_PORT]")
    p.add_argument("--api-key", dest="api_keys", action="append",
                   help="accepted API key; repeat for several (default: none required) [MOSS_API_KEYS]")
    p.add_argument("--allowed-origin", dest="allowed_origins", action="append",
                   help="allowed browser Origin; repeat for several (default: any) [MOSS_ALLOWED_ORIGINS]")
    p.add_argument("--workers", type=int,
                   help="server processes sharing the port and one engine (default 1); one process's event loop "
                        "carries ~100 real-time WebSocket sessions on a small CPU [MOSS_WORKERS]")
    p.add_argument("--max-sessions", type=int,
                   help="concurrent sessions (default: on a GPU, the engine's --max-running or the conversations "
                        f"of {SESSION_ROWS} rows its KV pool holds, whichever is fewer; on a CPU "
                        f"{CPU_MAX_SESSIONS}) [MOSS_MAX_SESSIONS]")
    p.add_argument("--max-message-bytes", type=int, help="largest WebSocket message (default 1 MiB)")
    p.add_argument("--max-input-buffer-seconds", type=float, help="uncommitted input audio limit (default 60)")
    p.add_argument("--max-answer-rows", type=int,
                   help="an answer's length in rows of 80 ms when the client sets no max_output_tokens (default 500)")
    p.add_argument("--output-queue-size", type=int, help="outbound events per session before 'slow_consumer'")
    p.add_argument("--slow-consumer-timeout-s", type=float,
                   help="close a WebSocket client that takes none of the bytes waiting for it this long as "
                        "'slow_consumer' (default 5)")
    p.add_argument("--drain-timeout-s", type=float, help="on SIGTERM, wait this long for answers (default 10)")
    p.add_argument("--header-timeout-s", type=float,
                   help="close a connection whose request head has not arrived in this time (default 10)")
    p.add_argument("--max-connections", type=int,
                   help="open connections past which HTTP requests get 503 (default 2048)")
    p.add_argument("--idle-timeout-s", type=float,
                   help="close a session whose client sends nothing this long while no answer runs (default 600)")
    p.add_argument("--engine-endpoint", help="ZeroMQ endpoint of the engine (default: a private ipc socket)")
    p.add_argument("--no-spawn-engine", dest="spawn_engine", action="store_const", const=False,
                   help="connect to an engine already running at --engine-endpoint instead of starting one")
    p.add_argument("--no-vad", dest="vad", action="store_const", const=False, help="disable server_vad")
    p.add_argument("--no-end-of-turn-model", dest="end_of_turn_model", action="store_const", const=False,
                   help="do not load the end-of-turn model (semantic_vad is then refused) [MOSS_END_OF_TURN_MODEL]")
    p.add_argument("--server-vad-end-of-turn", dest="server_vad_end_of_turn", action="store_const", const=True,
                   help="server_vad turns also end as soon as the end-of-turn model is confident, before "
                        "silence_duration_ms [MOSS_SERVER_VAD_END_OF_TURN]")
    p.add_argument("--speculative-server-vad", dest="speculative_server_vad", action="store_const", const=True,
                   help="server_vad answers start after ~160 ms of silence, held unheard until silence_duration_ms "
                        "confirms the turn, withdrawn if the user goes on [MOSS_SPECULATIVE_SERVER_VAD]")
    p.add_argument("--log-level", help="debug, info, warning, error (default info) [MOSS_LOG_LEVEL]")
    p.add_argument("--log-format", choices=("kv", "json"), help="key=value (default) or JSON lines")
    engine_options.add_arguments(p)
    serve_ray.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from server.app import create_app
    from server.ops.logs import setup_logging
    from server.serving import DrainingServer, raise_open_file_limit, uvicorn_config
    from server.settings import Settings, describe_errors

    ray_args = {k: getattr(args, k, None) for k in serve_ray.FLAGS}
    overrides = {k: v for k, v in vars(args).items() if v is not None and k not in serve_ray.FLAGS}
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        print(f"moss-speech serve: invalid settings:\n{describe_errors(e)}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format, secrets=settings.secrets())
    if ray_args["ray"] is not None:
        return serve_ray.run(settings, ray_args)
    if settings.max_sessions is not None and (advice := workers_advice(settings.max_sessions, settings.workers)):
        logging.getLogger("server").warning("%s", advice)
    if settings.workers > 1:
        from server.workers.supervisor import Supervisor

        return Supervisor(settings).run()
    app = create_app(settings, own_process=True)
    raise_open_file_limit(settings.max_connections)
    server = DrainingServer(uvicorn_config(app, settings.host, settings.port, settings.log_level))
    server.run()
    return 0 if server.started else 1
