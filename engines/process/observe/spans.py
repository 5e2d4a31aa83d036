"""Time per named part of the engine loop (count, total, max), reset at each load-log line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Spans:
    def __init__(self) -> None:
        self._acc: dict[str, list[float]] = {}  # name -> [count, seconds, max seconds]

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        a = self._acc.setdefault(name, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += seconds
        a[2] = max(a[2], seconds)

    def take(self) -> dict[str, tuple[int, float, float]]:
        out = {k: (int(v[0]), v[1], v[2]) for k, v in self._acc.items()}
        self._acc = {}
        return out

    @staticmethod
    def describe(taken: dict[str, tuple[int, float, float]]) -> str:
        """'encode 12x 3.1 ms (max 9.0)' for each part, most total time first."""
        parts = sorted(taken.items(), key=lambda kv: -kv[1][1])
        return ", ".join(f"{k} {n}x {1e3 * s / n:.1f} ms (max {1e3 * mx:.0f})" for k, (n, s, mx) in parts if n)
