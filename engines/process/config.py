"""The engine process's settings: its command-line options (options.py) checked together, with the defaults that
depend on the device decided, and the EngineConfig they make."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engines.audio.voice_prompt import check_voice_prompt
from engines.audio.wav import AudioFormatError
from engines.config import ConfigError, EngineConfig, model_config_for
from engines.lm.kv.sizing import GIB
from engines.process.limits import InputLimits
from engines.process.observe.gpu_window import WindowConfig
from engines.process.options import parser


@dataclass(frozen=True)
class ProcessConfig:
    """What `python -m engines.process.main` was asked to do (`--help` says what each option means). Made by
    `from_args`, which decides what `auto` and the per-device defaults are; checked as a whole on construction
    (ConfigError, naming the options)."""

    model: str
    codec: str  # or "none": no speech encoder or decoder
    device: str  # cpu | cuda[:N]
    dtype: str | None  # None: the model's (float32 on a CPU)
    endpoint: str
    vocoder: str | None  # None: decided from the codec directory (engines/speech_out/presets.py served_options)
    ready_file: str | None
    client_timeout_s: float
    kv_cache_gib: float | Literal["auto"] | None  # None: EngineConfig's default
    max_running: int | None
    step_rows: int | None
    ramp_step_rows: int | None
    fp8_weights: bool
    fp8_only: bool
    kv_dtype: str
    max_model_len: int | None
    seed: int
    voice: str | None  # the default voice's WAV; None: the bundled one
    max_text_chars: int
    max_output_tokens: int
    encode_every_ms: float
    encoder_thread: bool
    encoder_graphs: bool
    encoder_tf32: bool
    decoder_context: str
    decoder_cache_gib: float | None  # None: the decoder's default for the device
    decoder_cache_dtype: str  # "auto" (the estimator's) or "fp8"
    warm_up: bool
    first_lane: bool
    first_lanes: int
    codec_round_max: int | None
    codec_round_period_ms: float
    gpu_window: WindowConfig | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ProcessConfig:
        """From parsed options: `--device auto` becomes cuda when there is a GPU, else cpu; on a GPU the options
        left unset default to on (--encoder-thread, --warm-up, --first-lane) and the KV pool to auto."""
        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        on_gpu = device.startswith("cuda")
        window = None
        if args.gpu_window:
            try:
                window = WindowConfig.parse(args.gpu_window)
            except ValueError as e:
                raise ConfigError(f"--gpu-window: {e}") from None
        return cls(
            model=args.model, codec=args.codec, device=device, dtype=args.dtype, endpoint=args.endpoint,
            vocoder=args.vocoder, ready_file=args.ready_file, client_timeout_s=args.client_timeout_s,
            kv_cache_gib="auto" if args.kv_cache_gib is None and on_gpu else args.kv_cache_gib,
            max_running=args.max_running, step_rows=args.step_rows, ramp_step_rows=args.ramp_step_rows,
            fp8_weights=args.fp8_weights, fp8_only=args.fp8_only, kv_dtype=args.kv_dtype,
            max_model_len=args.max_model_len, seed=args.seed, voice=args.voice,
            max_text_chars=args.max_text_chars, max_output_tokens=args.max_output_tokens,
            encode_every_ms=args.encode_every_ms,
            encoder_thread=on_gpu if args.encoder_thread is None else args.encoder_thread,
            encoder_graphs=args.encoder_graphs, encoder_tf32=args.encoder_tf32,
            decoder_context=args.decoder_context, decoder_cache_gib=args.decoder_cache_gib,
            decoder_cache_dtype=args.decoder_cache_dtype,
            warm_up=on_gpu if args.warm_up is None else args.warm_up,
            first_lane=on_gpu if args.first_lane is None else args.first_lane, first_lanes=args.first_lanes,
            codec_round_max=args.codec_round_max, codec_round_period_ms=args.codec_round_period_ms,
            gpu_window=window)

    @classmethod
    def parse(cls, argv: list[str]) -> ProcessConfig:
        """From a command line as the engine process takes it (argparse exits on a malformed option)."""
        return cls.from_args(parser().parse_args(argv))

    def __post_init__(self) -> None:
        if self.device == "auto":
            raise ConfigError("--device auto is decided by ProcessConfig.from_args; give cpu or cuda[:N]")
        if self.client_timeout_s <= 0:
            raise ConfigError(f"--client-timeout-s must be > 0, got {self.client_timeout_s}")
        if self.kv_cache_gib == "auto" and not self.on_gpu:
            raise ConfigError(f"--kv-cache-gib auto sizes the pool from a GPU's free memory; give GiB on {self.device}")
        if self.kv_cache_gib not in (None, "auto") and not self.kv_cache_gib > 0:
            raise ConfigError(f"--kv-cache-gib must be > 0, got {self.kv_cache_gib}")
        for option, value, low in (("--step-rows", self.step_rows, 1), ("--ramp-step-rows", self.ramp_step_rows, 0),
                                   ("--first-lanes", self.first_lanes, 1),
                                   ("--codec-round-max", self.codec_round_max, 1)):
            if value is not None and value < low:
                raise ConfigError(f"{option} must be >= {low}, got {value}")
        for option, ms in (("--encode-every-ms", self.encode_every_ms),
                           ("--codec-round-period-ms", self.codec_round_period_ms)):
            if not 0 <= ms < math.inf:
                raise ConfigError(f"{option} must be a finite number >= 0, got {ms}")
        if self.step_rows is not None:
            running = self.max_running if self.max_running is not None else EngineConfig.max_running
            if self.step_rows <= running:
                raise ConfigError(f"--step-rows {self.step_rows} must exceed the sequences one step may decode "
                                  f"(--max-running {running}), so that prefill always makes progress beside them")
        try:
            self.input_limits()
        except ConfigError as e:
            raise ConfigError(f"--max-text-chars / --max-output-tokens: {e}") from None
        if self.voice is not None:
            if self.codec == "none":
                raise ConfigError("--voice needs a codec (--codec none speaks no audio)")
            try:
                check_voice_prompt(self.voice)
            except AudioFormatError as e:
                raise ConfigError(f"--voice {self.voice}: {e}") from None
        if self.decoder_cache_gib is not None and self.decoder_context != "full":
            raise ConfigError("--decoder-cache-gib sizes the full-context decoder's cache; --decoder-context "
                              f"{self.decoder_context} has none")
        if self.decoder_cache_dtype != "auto" and self.decoder_context != "full":
            raise ConfigError("--decoder-cache-dtype is the full-context decoder's cache's; --decoder-context "
                              f"{self.decoder_context} has none")
        if self.encoder_tf32 and not self.on_gpu:
            raise ConfigError(f"--encoder-tf32 needs a CUDA device (got --device {self.device})")
        if (self.codec_round_max is not None and self.codec != "none" and self.first_lane
                and self.codec_round_period_ms > 0):
            raise ConfigError("--codec-round-max bounds rounds of playing answers run back to back; with a first lane "
                              "they run once a period (--codec-round-period-ms) and take every answer due: give "
                              "--codec-round-period-ms 0 with it")

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def input_limits(self) -> InputLimits:
        return InputLimits(max_text_chars=self.max_text_chars, max_output_tokens=self.max_output_tokens)

    @property
    def kv_auto(self) -> bool:
        """The KV pool takes what the GPU has left once everything else is loaded (engines/lm/kv/sizing.py)."""
        return self.kv_cache_gib == "auto"

    def engine_config(self) -> EngineConfig:
        """The language model engine's settings (reads the model's config.json for its dtype where none is given)."""
        dtype = self.dtype or ("float32" if self.device == "cpu" else model_config_for(self.model).torch_dtype)
        kw: dict[str, Any] = {"device": self.device, "dtype": dtype}
        if isinstance(self.kv_cache_gib, float):
            kw["kv_cache_bytes"] = int(self.kv_cache_gib * GIB)
        if self.max_running is not None:
            kw["max_running"] = self.max_running
            kw["prefill_token_budget"] = max(EngineConfig.prefill_token_budget, 2 * self.max_running)
        if self.step_rows is not None:
            kw["prefill_token_budget"] = self.step_rows
        if self.max_model_len is not None:
            kw["max_model_len"] = self.max_model_len
        if self.ramp_step_rows is not None:
            kw["ramp_step_rows"] = self.ramp_step_rows
        kw["fp8_weights"] = self.fp8_weights
        kw["fp8_only"] = self.fp8_only
        kw["kv_dtype"] = self.kv_dtype
        return EngineConfig(**kw)
