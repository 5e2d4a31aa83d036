"""The engine process's load log: where the engine loop's time goes, one `load:` line (and a `load parts:` line) every
LOAD_LOG_S while it is busy, for load tests (engines/profiling/load_parts.py reads them)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from engines.api import step_row_labels
from engines.process.observe.spans import Spans
from engines.process.observe.stall_watch import StallWatch
from engines.process.service import Service

log = logging.getLogger("engines.process")

LOAD_LOG_S = 5.0


def solves(name: str, decoders: list[Any]) -> str:
    """'; playing solves 27 (3 partial) of 31.2 sessions as 40.1 rows' since the last call (decoders'
    take_counts), or '' with none."""
    cs = [d.take_counts() for d in decoders if hasattr(d, "take_counts")]
    n = sum(c.solves for c in cs)
    if not n:
        return ""
    rows, padded = sum(c.rows for c in cs), sum(c.padded_rows for c in cs)
    return (f"; {name} solves {n} ({sum(c.partial for c in cs)} partial) of {rows / n:.1f} sessions as "
            f"{padded / n:.1f} rows")


class LoadLog:
    """Where the engine loop's time goes, logged every LOAD_LOG_S while busy (for load tests)."""

    def __init__(self, service: Service, watch: StallWatch) -> None:
        self.service = service
        self.watch = watch  # its wake-up delays: how long the process's threads wait for the GIL
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.t0, self.steps, self.step_s, self.step_max, self.handle_s = now, 0, 0.0, 0.0, 0.0
        self.stats0 = self.service.engine.stats()  # (a copy: the counters at the start of the span)
        codec = self.service._codec
        self.codec0 = (codec.batches, codec.items, codec.busy_s) if codec is not None else None

    def handled(self, dt: float) -> None:
        self.handle_s += dt

    def stepped(self, dt: float) -> None:
        self.steps += 1
        self.step_s += dt
        self.step_max = max(self.step_max, dt)

    def maybe_log(self) -> None:
        now = time.monotonic()
        span = now - self.t0
        if span < LOAD_LOG_S:
            return
        if self.steps:
            st = self.service.engine.stats()
            codec = self.service._codec
            extra = ""
            if late := self.watch.take_wake_delays():
                q = np.percentile(late, [50, 95])
                extra += f"; GIL wait (watch wake-up delay) p50 {q[0]:.2f} / p95 {q[1]:.2f} / max {max(late):.1f} ms"
            if codec is not None and self.codec0 is not None:
                b, n, busy = (codec.batches - self.codec0[0], codec.items - self.codec0[1],
                              codec.busy_s - self.codec0[2])
                extra += f"; codec {b} batches, {n} items, busy {100 * busy / span:.0f}%"
                extra += solves("playing" if codec.first_decoders else "all", [codec.decoder])
                extra += solves("first-chunk", codec.first_decoders)
            s0 = self.stats0
            launched = st.steps - s0.steps
            refused = _count_deltas(st.ahead_refused, s0.ahead_refused)
            if refused:
                ramping = _count_deltas(st.ahead_refused_ramping, s0.ahead_refused_ramping)
                extra += "; not launched ahead: " + ", ".join(
                    f"{why} {n} ({ramping.get(why, 0)} ramping)" for why, n in refused.items())
            if launched:
                extra += "; steps by rows " + ", ".join(
                    f"{label}: {n - n0} ({r - r0} rows)" for label, n, n0, r, r0 in zip(
                        step_row_labels(), st.step_row_counts, s0.step_row_counts, st.step_row_sums,
                        s0.step_row_sums, strict=True) if n > n0)
            log.info("load: %d loop steps in %.1f s (%.1f ms mean, %.1f ms max), handling messages %.0f%%, "
                     "stepping %.0f%%; running %d, waiting %d; %d model steps (%d launched ahead) of %.2f decode "
                     "+ %.2f prompt rows, %.1f ms from tokens to the next launch, %.1f ms per launch%s",
                     self.steps, span, 1e3 * self.step_s / self.steps, 1e3 * self.step_max, 100 * self.handle_s / span,
                     100 * self.step_s / span, st.running, st.waiting, launched,
                     st.overlapped_steps - s0.overlapped_steps,
                     (st.decoded_rows - s0.decoded_rows) / max(launched, 1),
                     (st.prefilled_rows - s0.prefilled_rows) / max(launched, 1),
                     1e3 * (st.launch_gap_s - s0.launch_gap_s) / max(st.launch_gaps - s0.launch_gaps, 1),
                     1e3 * (st.launch_s - s0.launch_s) / max(launched, 1), extra)
            parts = self.service.spans.take()
            for worker in (codec, self.service._speech):
                if worker is not None:
                    parts.update(worker.take_spans())
            log.info("load parts: %s", Spans.describe(parts))
        self._reset(now)


def _count_deltas(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Counters that grew since `before`, by how much, largest first."""
    grown = {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}
    return dict(sorted(grown.items(), key=lambda kv: -kv[1]))

