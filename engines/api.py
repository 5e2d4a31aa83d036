"""Typed requests and outputs of the engine, and the errors it raises.

These are plain dataclasses so they cross the process boundary as msgpack maps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engines.config import ConfigError
from engines.protocol import errors

Mode = Literal["text", "audio"]
# "no_kv": refused while waiting, the KV pool being held by other conversations' histories (Scheduler.schedule)
FinishReason = Literal["stop", "length", "abort", "error", "no_kv"]


@dataclass(frozen=True)
class ChannelSampling:
    """Sampling of one channel (the published defaults)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    repetition_penalty: float = 1.1

    def __post_init__(self) -> None:
        if not (self.temperature >= 0):
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (self.repetition_penalty > 0):
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass(frozen=True)
class SamplingParams:
    text: ChannelSampling = field(default_factory=ChannelSampling)
    audio: ChannelSampling = field(default_factory=ChannelSampling)
    greedy: bool = False  # argmax on both channels (lowest index wins ties); penalties still apply
    min_new_tokens: int = 0  # eosp is masked until this many rows were generated
    max_new_tokens: int = 500
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be an int in [0, 2**63), got {self.seed!r}")

    @classmethod
    def greedy_params(cls, max_new_tokens: int = 500, min_new_tokens: int = 0) -> SamplingParams:
        return cls(greedy=True, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)


@dataclass(frozen=True)
class StepOutput:
    """One generated row of one request, emitted by `Engine.step()`."""

    request_id: str
    text_token: int
    audio_token: int
    mode: Mode  # mode in which this row was generated
    finished: bool = False
    finish_reason: FinishReason | None = None


# Upper bounds of EngineStats' step row buckets (one more bucket above the last)
STEP_ROW_BUCKETS = (16, 32, 64, 128)


def step_row_bucket(rows: int) -> int:
    """The index of the bucket a step of `rows` rows counts in."""
    return next((i for i, top in enumerate(STEP_ROW_BUCKETS) if rows <= top), len(STEP_ROW_BUCKETS))


def step_row_labels() -> list[str]:
    """'1-16', '17-32', ..., '>128': one per bucket."""
    lows = [1] + [top + 1 for top in STEP_ROW_BUCKETS]
    return [f"{lo}-{hi}" for lo, hi in zip(lows, STEP_ROW_BUCKETS, strict=False)] + [f">{STEP_ROW_BUCKETS[-1]}"]


@dataclass
class EngineStats:
    """Counters for tests and metrics."""

    steps: int = 0
    prefilled_rows: int = 0  # rows run through the model as prompt (not generated)
    decoded_rows: int = 0
    overlapped_steps: int = 0  # launched before the previous step's tokens were read
    # Host time from a step's tokens (read while more work was scheduled) to the next step's launch: the GPU has
    # none of this engine's work meanwhile.
    launch_gaps: int = 0
    launch_gap_s: float = 0.0
    launch_s: float = 0.0  # host time spent launching steps (inputs, graph replay, sampler), over `steps`
    # Steps launched, and their rows, by row count (STEP_ROW_BUCKETS): which GEMM path the steps under load take (the
    # skinny kernel's 16- and 32-row tiles, then the larger GEMMs), which the means alone do not say.
    step_row_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_ROW_BUCKETS) + 1))
    step_row_sums: list[int] = field(default_factory=lambda: [0] * (len(STEP_ROW_BUCKETS) + 1))
    # Steps not launched ahead, by why (Scheduler.ahead_refusal: AHEAD_REFUSALS), and those of them where an answer
    # in the step before still ramped (its first audio waits on the host's turn between the two).
    ahead_refused: dict[str, int] = field(default_factory=dict)
    ahead_refused_ramping: dict[str, int] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


class EngineError(Exception):
    """Base of the errors the engine raises to its caller; `code` is stable for clients (engines.protocol.errors)."""

    code = errors.ENGINE_ERROR


class InvalidRequestError(EngineError):
    code = errors.INVALID_REQUEST


class QueueFullError(EngineError):
    code = errors.SERVER_BUSY


class RequestTooLargeError(EngineError):
    code = errors.REQUEST_TOO_LARGE
