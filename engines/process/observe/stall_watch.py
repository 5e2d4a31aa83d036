"""Say where the engine loop stalls: stack samples of every thread while one loop section runs long, and GC pauses.

Every session waits for the engine loop, so one 300 ms call is a 300 ms hole in everyone's audio. Timing the
loop's parts says *which* part stalled, not *why*; under load the GPU is mostly idle during such stalls, so the
cause is on the host (another thread holding the GIL, a first-time compile or plan build, a collection). A
daemon thread wakes every `period_s`; while a section has run longer than `threshold_s` it samples the stack of
every thread. When the section ends, the most frequent stacks are logged with the stall's length. The thread
also notes when it wakes far later than asked: that is one call holding the GIL the whole time.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger("engines.process.stall")

FRAMES = 6  # innermost frames kept per sample: enough to name the call and its caller chain


@dataclass
class Stall:
    section: str
    seconds: float
    samples: dict[str, Counter] = field(default_factory=dict)  # thread name -> stack text -> count
    late_wakes_ms: list[float] = field(default_factory=list)  # watch-thread wake-ups this much past schedule

    def describe(self, top: int = 2) -> str:
        parts = [f"stall in {self.section}: {1e3 * self.seconds:.0f} ms"]
        if self.late_wakes_ms:
            parts.append(f"watch woke up to {max(self.late_wakes_ms):.0f} ms late (one call held the GIL)")
        for name, stacks in self.samples.items():
            n = sum(stacks.values())
            for stack, k in stacks.most_common(top):
                parts.append(f"[{name}] {k}/{n} samples:\n{stack}")
        return "\n".join(parts)


class StallWatch:
    def __init__(self, threshold_s: float = 0.1, period_s: float = 0.02, late_s: float = 0.05) -> None:
        self.threshold_s, self.period_s, self.late_s = threshold_s, period_s, late_s
        self.stalls: list[Stall] = []  # the last few, for tests and stats
        self.gc_pauses_ms: list[float] = []  # collections longer than GC_LOG_MS since the last take
        # Every wake-up's delay past its schedule since the last take: a sleeping thread needs the GIL back to run,
        # so these sample how long any thread of the process waits for it (plus the OS's wake-up latency).
        self.wake_delays_ms: list[float] = []
        self._lock = threading.Lock()
        self._section: str | None = None
        self._since = 0.0
        self._current: Stall | None = None
        self._owner = threading.get_ident()
        self._gc_t0 = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        gc.callbacks.append(self._on_gc)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Watch one call of the loop; a stall inside it is logged when it returns."""
        with self._lock:
            self._section, self._since, self._current = name, time.perf_counter(), None
        try:
            yield
        finally:
            with self._lock:
                stall, self._section, self._current = self._current, None, None
            if stall is not None:
                stall.seconds = time.perf_counter() - self._since
                self.stalls = [*self.stalls[-9:], stall]
                log.warning("%s", stall.describe())

    def take_gc_pauses(self) -> list[float]:
        out, self.gc_pauses_ms = self.gc_pauses_ms, []
        return out

    def take_wake_delays(self) -> list[float]:
        """Wake-up delays (ms) since the last take (at most MAX_WAKES kept; the newest)."""
        with self._lock:
            out, self.wake_delays_ms = self.wake_delays_ms, []
        return out

    # ---- watch thread ---------------------------------------------------------------------

    def _run(self) -> None:
        due = time.perf_counter() + self.period_s
        while not self._stop.wait(max(0.0, due - time.perf_counter())):
            now = time.perf_counter()
            late = now - due
            due = now + self.period_s
            with self._lock:
                self.wake_delays_ms.append(1e3 * late)
                if len(self.wake_delays_ms) > MAX_WAKES:
                    del self.wake_delays_ms[:-MAX_WAKES // 2]
                if self._section is None or now - self._since < self.threshold_s:
                    continue
                if self._current is None:
                    self._current = Stall(self._section, 0.0)
                stall = self._current
            if late > self.late_s:
                stall.late_wakes_ms.append(1e3 * late)
            self._sample(stall)

    def _sample(self, stall: Stall) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = "loop" if ident == self._owner else names.get(ident, str(ident))
            frames = traceback.extract_stack(frame)[-FRAMES:]
            text = "\n".join(f"    {f.filename.rsplit('/', 2)[-2:][-1]}:{f.lineno} {f.name}" for f in frames)
            stall.samples.setdefault(name, Counter())[text] += 1

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0:
            ms = 1e3 * (time.perf_counter() - self._gc_t0)
            self._gc_t0 = 0.0
            if ms >= GC_LOG_MS:
                self.gc_pauses_ms.append(ms)
                log.warning("gc generation %d paused the process %.0f ms (%d collected)", info.get("generation", -1),
                            ms, info.get("collected", 0))


GC_LOG_MS = 20.0
MAX_WAKES = 4096  # wake-up delays kept between takes (~80 s of wake-ups at the default period)
