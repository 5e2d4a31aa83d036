"""Server settings: environment variables with the `MOSS_` prefix, overridden by `moss-speech serve` flags.

Lists (api_keys, allowed_origins, engine_command) are given in the environment as JSON
(`MOSS_API_KEYS='["k1","k2"]'`) or comma separated (`MOSS_API_KEYS=k1,k2`). A variable set to the empty string
counts as unset. Every option of the engine process is a setting too (server/engine_options.py).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from typing import Annotated, Any

from pydantic import Field, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from server import engine_options


def _split(v: Any) -> Any:
    if isinstance(v, str):
        v = v.strip()
        if v.startswith("["):
            import json

            return json.loads(v)
        return [x.strip() for x in v.split(",") if x.strip()]
    return v


RANDOM_PRESETS = {"tiny-random", "full-random"}


def gpu_count() -> int:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES, else the driver's list), without loading CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


# The engine process's options, one field each (None: the engine's default), beside the server's own below.
_EngineSettings = create_model("_EngineSettings", __base__=BaseSettings, **engine_options.settings_fields())


class Settings(_EngineSettings):
    model_config = SettingsConfigDict(env_prefix=engine_options.ENV_PREFIX, extra="forbid", env_ignore_empty=True)

    @property
    def random_weights(self) -> bool:
        """True when the model or the codec is a random preset: answers are noise (the log and page say so)."""
        return bool({self.model, self.codec} & RANDOM_PRESETS)

    # What to serve
    model: str = "tiny-random"  # tiny-random or a MOSS-Speech checkpoint directory
    codec: str = "tiny-random"  # tiny-random or a MOSS-Speech-Codec directory
    device: str = "auto"  # passed to the engine: auto, cpu, cuda, cuda:N
    gpus: str | None = Field(None, pattern="^(all|[1-9][0-9]*)$")  # one engine per GPU (N, or all); None: one engine
    vocoder: str | None = Field(None, pattern="^(bigvgan|hift)$")  # None: the engine's default for the codec
    model_name: str = "moss-speech"  # the `model` reported to clients (session.model)

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: str = "info"
    log_format: str = Field("kv", pattern="^(kv|json)$")
    workers: int = Field(1, ge=1, le=64)  # server processes behind the port, sharing one engine (server/workers/)

    # Access
    api_keys: Annotated[list[str], NoDecode] = []  # empty: no key required
    allowed_origins: Annotated[list[str], NoDecode] = []  # empty: any Origin (and none) accepted; "*" too

    # Limits
    max_sessions: int | None = Field(None, ge=1)  # None: sized from the engine once it is ready (server/limits.py)
    max_message_bytes: int = Field(1 << 20, ge=1024)  # a WebSocket message above this closes with 1009
    max_input_buffer_seconds: float = Field(60.0, gt=0)
    max_answer_rows: int = Field(500, ge=1, le=1 << 20)  # an answer's length when the client sets no limit (40 s)
    output_queue_size: int = Field(1024, ge=8)  # outbound events per session before it is closed as slow
    # a WebSocket client that takes none of the bytes waiting for it this long is closed as slow (1008)
    slow_consumer_timeout_s: float = Field(5.0, gt=0)
    drain_timeout_s: float = Field(10.0, ge=0)
    idle_timeout_s: float = Field(600.0, gt=0)  # a session whose client sends nothing this long is closed
    header_timeout_s: float = Field(10.0, gt=0)  # a connection's request head must arrive within this
    max_connections: int = Field(2048, ge=16)  # open connections past which HTTP requests get 503

    # Engine process
    engine_endpoint: str | None = None  # default: an ipc:// socket in the temp directory, unique per server
    spawn_engine: bool = True  # False: connect to an engine started elsewhere at engine_endpoint
    engine_command: Annotated[list[str] | None, NoDecode] = None  # replaces the engine command (tests, wrappers)
    engine_ready_timeout_s: float = Field(600.0, gt=0)
    engine_ping_interval_s: float = Field(1.0, gt=0)
    engine_ping_timeout_s: float = Field(30.0, gt=0)

    # Turn detection
    vad: bool = True  # False: server_vad is refused (clients must commit)
    end_of_turn_model: bool = True  # the end-of-turn model (server/turn_model.py); False: semantic_vad is refused
    server_vad_end_of_turn: bool = False  # server_vad turns end early too when that model is confident
    speculative_server_vad: bool = False  # server_vad answers start (held) after a short silence (turn_detection.py)

    # WebRTC (server/transports/webrtc/config.py). ICE servers in RTCIceServer JSON, e.g. MOSS_ICE_SERVERS=
    # '[{"urls":"stun:s.example.org:3478"},{"urls":"turn:t.example.org:3478","username":"u","credential":"p"}]'
    ice_servers: list[dict[str, Any]] = []  # empty: host candidates only (localhost, LAN)
    # TURN REST API shared secret (coturn's static-auth-secret): TURN servers in ice_servers are then listed without
    # a username and credential, and each client gets time-limited ones, valid turn_ttl_s
    turn_secret: str | None = None
    turn_ttl_s: int = Field(86400, ge=60)
    max_calls: int = Field(16, ge=0)  # concurrent WebRTC calls (each is also a session)
    ice_timeout_s: float = Field(20.0, ge=1, le=600)  # a call whose ICE has not connected by then is closed
    webrtc_prebuffer_ms: int = Field(60, ge=0, le=1000)  # outbound jitter buffer before an answer plays

    @field_validator("api_keys", "allowed_origins", "engine_command", mode="before")
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return _split(v)

    def secrets(self) -> list[str]:
        """What logs must never show (server/ops/logs.py redacts each)."""
        return [*self.api_keys, *([self.turn_secret] if self.turn_secret else [])]

    @model_validator(mode="after")
    def _gpus(self) -> Settings:
        if self.gpus is None:
            return self
        where = "MOSS_GPUS (--gpus)"
        if self.workers > 1:
            raise ValueError(f"{where}: its engines are placed on by one server process; leave --workers at 1")
        if self.engine_endpoint or not self.spawn_engine:
            raise ValueError(f"{where}: the server starts these engines itself, each on a private socket; unset "
                             "--engine-endpoint and --no-spawn-engine")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"{where}: each engine gets a GPU of its own, so --device is auto, cuda or cpu "
                             f"(got {self.device!r})")
        if self.gpus == "all" and self.device == "cpu":
            raise ValueError(f"{where}: 'all' counts GPUs; with --device cpu give the number of engines")
        if self.device != "cpu" and (n := gpu_count()) < (1 if self.gpus == "all" else int(self.gpus)):
            raise ValueError(f"{where}: this host has {n} GPU(s) (CUDA_VISIBLE_DEVICES, else the driver's list)")
        return self

    def engine_devices(self, gpu_count: int) -> list[str]:
        """The device of each engine: one engine on `device`, or with `gpus` one per GPU (cuda:0, cuda:1...; on the
        CPU, N engines on cpu). `gpu_count` is the GPUs this host has."""
        if self.gpus is None:
            return [self.device]
        n = gpu_count if self.gpus == "all" else int(self.gpus)
        if self.device == "cpu":
            return ["cpu"] * n
        return [f"cuda:{i}" for i in range(n)]  # (the settings' check saw that many)

    @model_validator(mode="after")
    def _end_of_turn(self) -> Settings:
        if self.server_vad_end_of_turn and not (self.vad and self.end_of_turn_model):
            raise ValueError("server_vad_end_of_turn needs the VAD and the end-of-turn model (vad, end_of_turn_model)")
        return self

    def resolved_endpoint(self) -> str:
        if self.engine_endpoint:
            return self.engine_endpoint
        name = f"moss-speech-engine-{os.getpid()}-{secrets.token_hex(4)}.sock"
        return "ipc://" + os.path.join(tempfile.gettempdir(), name)


_clash = set(_EngineSettings.model_fields) & set(Settings.__annotations__)
if _clash:
    raise TypeError(f"engine options {sorted(_clash)} have the names of server settings: rename one of each")


def describe_errors(e: ValidationError) -> str:
    """One line per invalid setting, named by its environment variable (and flag, for an engine option)."""
    lines = []
    for err in e.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a check across settings: its message names them
            lines.append(f"  {msg}")
            continue
        name = str(err["loc"][0])
        where = engine_options.ENV_PREFIX + name.upper()
        if name in engine_options.BY_DEST:
            where += f" ({engine_options.BY_DEST[name].flag})"
        got = err.get("input")
        lines.append(f"  {where}: {msg}" + ("" if isinstance(got, dict) or str(got) in msg else f" (got {got!r})"))
    return "\n".join(lines)
