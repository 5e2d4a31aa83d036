"""Percentiles and the simulated playback buffer (underrun accounting)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SAMPLE_RATE = 24000


def percentile(values: Iterable[float], q: float) -> float | None:
    """q in [0, 100]; linear interpolation between closest ranks (numpy's default). None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_interval(values: Iterable[float], q: float, confidence: float = 0.9) -> tuple[float, float] | None:
    """A distribution-free interval for the q-th percentile of what `values` were drawn from: two of the values
    (order statistics) that enclose it with probability >= `confidence`. The count of draws below the true
    percentile is binomial(n, q / 100), so the ranks come from its tails, alpha / 2 each; nothing is resampled. None
    when there are too few values to reach the confidence (for p95 at 90%: fewer than 59)."""
    if not 0 < q < 100:
        raise ValueError(f"percentile q must be in (0, 100), got {q}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    xs = sorted(float(v) for v in values)
    n, p, tail = len(xs), q / 100.0, (1.0 - confidence) / 2
    if n == 0:
        return None
    log_p, log_1p = math.log(p), math.log1p(-p)
    cdf, below = 0.0, []  # below[k] = P(K <= k), K ~ binomial(n, p): draws under the true percentile
    for k in range(n + 1):
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p
                        + (n - k) * log_1p)
        below.append(cdf)
    # The true percentile lies above x_(r) (1-based) unless K < r, and below x_(s) unless K >= s.
    lo = max((r for r in range(1, n + 1) if below[r - 1] <= tail), default=None)
    hi = min((s for s in range(1, n + 1) if below[s - 1] >= 1.0 - tail), default=None)
    if lo is None or hi is None:
        return None
    return xs[lo - 1], xs[hi - 1]


SUMMARY_KEYS = ("count", "mean", "p50", "p95", "p99", "max")


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
    """count/mean/p50/p95/p99/max of the non-None values (None fields when there are none), and `p95_ci`: the p95's
    90% interval [low, high] (percentile_interval; None below 59 values)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None, "p95_ci": None}
    ci = percentile_interval(xs, 95)
    return {
        "count": len(xs),
        "mean": sum(xs) / len(xs),
        "p50": percentile(xs, 50),
        "p95": percentile(xs, 95),
        "p99": percentile(xs, 99),
        "max": max(xs),
        "p95_ci": None if ci is None else list(ci),
    }


@dataclass
class PlaybackBuffer:
    """A listener's playback buffer for one response, drained at `sample_rate` against wall-clock time.

    Playback starts once `prebuffer_s` of audio is buffered (a jitter buffer; 0 = play the first chunk at once)
    or when the response ends, whichever comes first. An underrun is a chunk arriving after the buffer already
    ran dry: the listener heard a hole. After an underrun playback resumes with the arriving chunk.
    Audio still buffered when the response ends plays out normally and is not an underrun.
    """

    sample_rate: int = SAMPLE_RATE
    prebuffer_s: float = 0.0
    underruns: int = 0
    stall_s: float = 0.0  # total silence heard between the first and the last chunk
    samples: int = 0
    started_at: float | None = None  # wall time playback started
    play_end: float | None = None  # wall time the buffered audio runs out (while playing)
    min_lead_s: float | None = None  # smallest buffer level seen when a chunk arrived (while playing)
    _pending_s: float = 0.0  # buffered before playback started

    def __post_init__(self) -> None:
        if self.sample_rate <= 0:
            raise ValueError(f"sample_rate must be > 0, got {self.sample_rate}")
        if not self.prebuffer_s >= 0:
            raise ValueError(f"prebuffer_s must be >= 0, got {self.prebuffer_s}")

    def on_audio(self, t: float, n_samples: int) -> None:
        """`n_samples` of audio arrived at wall time `t` (seconds, monotonic)."""
        if n_samples < 0:
            raise ValueError(f"n_samples must be >= 0, got {n_samples}")
        dur = n_samples / self.sample_rate
        self.samples += n_samples
        if self.play_end is None:
            self._pending_s += dur
            if self._pending_s >= self.prebuffer_s and self._pending_s > 0:
                self.started_at = t
                self.play_end = t + self._pending_s
            return
        lead = self.play_end - t
        self.min_lead_s = lead if self.min_lead_s is None else min(self.min_lead_s, lead)
        if lead < -0.5 / self.sample_rate:  # late by more than half a sample (float noise is not a hole)
            self.underruns += 1
            self.stall_s += -lead
            self.play_end = t + dur
        else:
            self.play_end += dur

    def finish(self, t: float) -> float:
        """The response ended at `t`; returns the wall time its last sample is heard (t if nothing was received)."""
        if self.play_end is None:
            if self._pending_s > 0:
                self.started_at = t
                self.play_end = t + self._pending_s
            else:
                return t
        return max(self.play_end, t)

    @property
    def audio_s(self) -> float:
        return self.samples / self.sample_rate


def b64_decoded_len(s: str) -> int:
    """Bytes a standard base64 string decodes to, without decoding it (the client only needs the count)."""
    n = len(s)
    if n % 4:
        raise ValueError(f"base64 length {n} is not a multiple of 4")
    pad = 2 if s.endswith("==") else 1 if s.endswith("=") else 0
    return n // 4 * 3 - pad
