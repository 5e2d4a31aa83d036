"""Places under a limit (the server's sessions), counted in one process or across the server's workers.

With `moss-speech serve --workers N` every worker process admits sessions, and `max_sessions` is the
server's limit, not each worker's: `SharedSlots` keeps one count per worker in shared memory and admits
under one lock, so a worker that dies can have its count zeroed by the supervisor without touching
the others'.
"""

from __future__ import annotations

from typing import Any


class Slots:
    """A counted limit in one process."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a limit of {limit} admits nothing; it must be >= 1")
        self.limit = limit
        self._used = 0

    def try_take(self) -> bool:
        if self._used >= self.limit:
            return False
        self._used += 1
        return True

    def put_back(self) -> None:
        if self._used <= 0:
            raise RuntimeError("a slot was put back that was never taken")
        self._used -= 1

    def in_use(self) -> int:
        return self._used


class SharedSlots(Slots):
    """The count of worker `index` in `counts` (a multiprocessing Array of ints, one per worker)."""

    def __init__(self, counts: Any, index: int, limit: int) -> None:
        super().__init__(limit)
        if not 0 <= index < len(counts):
            raise ValueError(f"worker index {index} is outside the {len(counts)} shared counts")
        self._counts = counts
        self._index = index

    def try_take(self) -> bool:
        with self._counts.get_lock():
            if sum(self._counts[:]) >= self.limit:
                return False
            self._counts[self._index] += 1
            return True

    def put_back(self) -> None:
        with self._counts.get_lock():
            if self._counts[self._index] <= 0:
                raise RuntimeError("a slot was put back that was never taken")
            self._counts[self._index] -= 1

    def in_use(self) -> int:
        with self._counts.get_lock():
            return sum(self._counts[:])
