"""Places under a limit (the server's sessions), counted in one process or across the server's workers.

With `moss-speech serve --workers N` every worker process admits sessions, and `max_sessions` is the
server's limit, not each worker's: `SharedSlots` keeps one count per worker in shared memory (each
worker writes only its own) and admits under an flock on a file, which the kernel releases if its
holder dies (a semaphore held by a killed worker would stop every other worker's admissions for good).
The supervisor zeroes a dead worker's count.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any


class Slots:
    """A counted limit in one process."""

    def __init__(self, limit: int) -> None:
        self.set_limit(limit)
        self._used = 0

    def set_limit(self, limit: int) -> None:
        """A new limit: sessions over it stay, new ones wait until fewer than it are left."""
        if limit < 1:
            raise ValueError(f"a limit of {limit} admits nothing; it must be >= 1")
        self.limit = limit

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
    """The count of worker `index` in `counts` (a shared array of ints, one per worker), admitted under
    an exclusive flock on `lock_path` (the same file for every worker)."""

    def __init__(self, counts: Any, index: int, limit: int, lock_path: str) -> None:
        super().__init__(limit)
        if not 0 <= index < len(counts):
            raise ValueError(f"worker index {index} is outside the {len(counts)} shared counts")
        self._counts = counts
        self._index = index
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)

    def try_take(self) -> bool:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held for a sum of a few ints
        try:
            if sum(self._counts[:]) >= self.limit:
                return False
            self._counts[self._index] += 1
            return True
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def put_back(self) -> None:
        # Only this worker writes its own count: no lock needed to lower it.
        if self._counts[self._index] <= 0:
            raise RuntimeError("a slot was put back that was never taken")
        self._counts[self._index] -= 1

    def in_use(self) -> int:
        return sum(self._counts[:])

    def close(self) -> None:
        os.close(self._lock_fd)
