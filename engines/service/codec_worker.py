"""Speech decoding off the engine loop: one thread (and, on a GPU, its own CUDA stream) runs codec batches
while the language model keeps stepping, so a codec call no longer stalls every stream's next row.

The Service hands over a batch of (session, response, codes) items and later collects `(items, result)`
pairs on its own thread; the worker never touches session state, only the decoder streams it was given
(each stream is used by one thread at a time: the Service flushes the worker before it finalizes one).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch


class CodecWorker:
    def __init__(self, compute: Callable[[list], Any], device: torch.device) -> None:
        self._compute = compute
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cv = threading.Condition()
        self._jobs: deque[list] = deque()
        self._results: deque[tuple[list, Any]] = deque()
        self._in_flight = 0
        self._closed = False
        self.batches = 0  # counters for the engine process's load log
        self.items = 0
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="codec-worker", daemon=True)
        self._thread.start()

    def submit(self, items: list) -> None:
        with self._cv:
            self._jobs.append(items)
            self._in_flight += 1
            self._cv.notify_all()

    @property
    def idle(self) -> bool:
        with self._cv:
            return self._in_flight == 0

    def busy(self) -> bool:
        """Work queued, running, or results not yet collected."""
        with self._cv:
            return self._in_flight > 0 or bool(self._results)

    def take_results(self) -> list[tuple[list, Any]]:
        with self._cv:
            out = list(self._results)
            self._results.clear()
            return out

    def flush(self) -> None:
        """Wait until every submitted batch has run."""
        with self._cv:
            self._cv.wait_for(lambda: self._in_flight == 0)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if self._closed and not self._jobs:
                    return
                items = self._jobs.popleft()
            t0 = time.perf_counter()
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        result: Any = self._compute(items)
                else:
                    result = self._compute(items)
            except Exception as e:  # noqa: BLE001 - handed back: the Service fails those answers
                result = e
            with self._cv:
                self.batches += 1
                self.items += len(items)
                self.busy_s += time.perf_counter() - t0
                self._results.append((items, result))
                self._in_flight -= 1
                self._cv.notify_all()
