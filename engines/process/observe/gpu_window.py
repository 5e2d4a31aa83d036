"""A window on the engine process's device work under load (`--gpu-window SESSIONS,SECONDS,PATH`).

Once SESSIONS sessions are open, the torch profiler records, for SECONDS, every kernel and copy the process puts on
the GPU: the engine loop's steps, the codec worker's rounds and the speech encoder's calls, each on its own streams
and threads (CUPTI traces the whole process). Then it writes them to PATH as arrays and logs each stream's busy time.
It answers what the stage marks cannot: what runs beside a decode step when that step is slow. A development
instrument: the profiler slows launches, and starting and stopping it stalled the loop for seconds at 100 sessions
on an H200, so the load level it runs in is lost as a capacity figure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowConfig:
    sessions: int  # open sessions that start the window
    seconds: float  # its length
    path: Path  # where the events go (.npz)

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError(f"the window's session count must be >= 1, got {self.sessions}")
        if not 0 < self.seconds <= 60:
            raise ValueError(f"the window's length must be in (0, 60] s, got {self.seconds}")

    @classmethod
    def parse(cls, spec: str) -> WindowConfig:
        """'SESSIONS,SECONDS,PATH', e.g. '100,2,/tmp/window.npz'."""
        parts = spec.split(",", 2)
        if len(parts) != 3 or not parts[2]:
            raise ValueError(f"expected SESSIONS,SECONDS,PATH, got {spec!r}")
        try:
            return cls(int(parts[0]), float(parts[1]), Path(parts[2]))
        except ValueError as e:
            raise ValueError(f"bad window {spec!r}: {e}") from None


@dataclass
class Events:
    """The recorded device work (host work where the profiler records host activity only), times in us from the
    first event."""

    start: np.ndarray  # [n] float64
    duration: np.ndarray  # [n] float64
    stream: np.ndarray  # [n] int64: the CUDA stream (a thread id for host events)
    correlation: np.ndarray  # [n] int64: the launch it came from (a graph replay's kernels share one)
    name: np.ndarray  # [n] int64: index into names
    names: list[str]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, start=self.start, duration=self.duration, stream=self.stream,
                            correlation=self.correlation, name=self.name, names=np.array(self.names))

    @classmethod
    def load(cls, path: Path) -> Events:
        z = np.load(path)
        return cls(z["start"], z["duration"], z["stream"], z["correlation"], z["name"], [str(n) for n in z["names"]])


def busy_us(start: np.ndarray, duration: np.ndarray) -> float:
    """Length of the union of the intervals [start, start + duration)."""
    order = np.argsort(start, kind="stable")
    total, end = 0.0, -np.inf
    for s, e in zip(start[order], start[order] + duration[order], strict=True):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return float(total)


def summary(ev: Events, span_us: float, top: int = 3) -> list[str]:
    """One line per stream, busiest first: events, busy time and share of the window, its most costly names."""
    lines = [f"window {span_us / 1e3:.0f} ms, any stream busy {busy_us(ev.start, ev.duration) / 1e3:.1f} ms"]
    rows = []
    for s in np.unique(ev.stream):
        sel = ev.stream == s
        busy = busy_us(ev.start[sel], ev.duration[sel])
        by_name = np.bincount(ev.name[sel], weights=ev.duration[sel], minlength=len(ev.names))
        best = np.argsort(-by_name)[:top]
        names = ", ".join(f"{ev.names[i][:40]} {by_name[i] / 1e3:.1f} ms" for i in best if by_name[i] > 0)
        rows.append((busy, f"stream {int(s)}: {int(sel.sum())} events, busy {busy / 1e3:.1f} ms "
                           f"({100 * busy / max(span_us, 1e-9):.0f}%): {names}"))
    return lines + [r for _, r in sorted(rows, key=lambda r: -r[0])]


class GpuWindow:
    """Polled by the engine loop (`poll`), so the profiler starts and stops on the loop's thread."""

    def __init__(self, config: WindowConfig, activities: list[ProfilerActivity] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.activities = activities or [ProfilerActivity.CUDA]
        self.clock = clock
        self.done = False
        self._prof: profile | None = None
        self._t0 = 0.0

    def poll(self, open_sessions: int) -> None:
        if self.done:
            return
        if self._prof is None:
            if open_sessions >= self.config.sessions:
                log.info("gpu window: %d sessions open, recording %.1f s", open_sessions, self.config.seconds)
                self._prof = profile(activities=self.activities)
                self._prof.start()
                self._t0 = self.clock()
        elif self.clock() - self._t0 >= self.config.seconds:
            self.finish()

    def finish(self) -> Events | None:
        """Stop (if recording), write the events and log the summary."""
        prof, self._prof, self.done = self._prof, None, True
        if prof is None:
            return None
        prof.stop()
        ev = _events(prof, self.activities)
        # The events' own span: the profiler's start and stop each stall this thread for up to seconds under load.
        span_us = float((ev.start + ev.duration).max()) if len(ev.start) else 0.0
        ev.save(self.config.path)
        for line in summary(ev, span_us):
            log.info("gpu window: %s", line)
        log.info("gpu window: %d events written to %s", len(ev.start), self.config.path)
        return ev


def _events(prof: profile, activities: list[ProfilerActivity]) -> Events:
    device = ProfilerActivity.CUDA in activities
    want = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    raw = [e for e in prof.profiler.kineto_results.events() if e.device_type() == want]
    index: dict[str, int] = {}
    start = np.array([e.start_ns() / 1e3 for e in raw], dtype=np.float64)
    if len(start):
        start -= start.min()
    return Events(
        start=start,
        duration=np.array([e.duration_ns() / 1e3 for e in raw], dtype=np.float64),
        stream=np.array([e.device_resource_id() for e in raw], dtype=np.int64),
        correlation=np.array([e.correlation_id() for e in raw], dtype=np.int64),
        name=np.array([index.setdefault(e.name(), len(index)) for e in raw], dtype=np.int64),
        names=list(index),
    )
