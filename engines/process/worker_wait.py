"""The wait of the service's worker threads (codec rounds, encoder calls) for their next piece of work."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for_work(cv: threading.Condition, closed: Callable[[], bool], take: Callable[[float], T | None],
                  wake_at: Callable[[float], float], clock: Callable[[], float], floor_s: float) -> T | None:
    """With `cv` held: `take(now)`'s work as soon as it gives some, or None once `closed()`. In between, wait on
    `cv` (the engine loop notifies it when it hands over work) until `wake_at(now)`, when held work falls due
    (math.inf: none is held), at least `floor_s` at a time."""
    while not closed():
        now = clock()
        work = take(now)
        if work is not None:
            return work
        at = wake_at(now)
        cv.wait(None if at == math.inf else max(floor_s, at - now))
    return None
