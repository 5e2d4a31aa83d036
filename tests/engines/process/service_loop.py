"""The engine process's loop for tests: step a Service; while only one of its worker threads (codec, encoder, voice
prompts) is busy, wait on that worker's condition for its next result instead of spinning (the process's loop sleeps
a little)."""

from __future__ import annotations

from typing import Any

from engines.process.service import Out, Service

WAIT_S = 60.0  # bound on a wait for a worker thread: a hang fails the test instead of blocking it


def wait_for_worker(worker: Any) -> None:
    """Until the worker posts a result or has nothing left (both notify its condition)."""
    with worker._cv:
        assert worker._cv.wait_for(lambda: worker._results or not worker.busy(), WAIT_S), (
            f"{type(worker).__name__} is stuck")


def step(svc: Service) -> list[Out]:
    """One iteration: with the engine idle, first the next result of a busy worker thread; then a step."""
    if not svc.engine.has_work():
        speech = [svc._speech] if svc._speech is not None and svc._speech.threaded else []
        threads = [svc._codec, svc._voices, *speech]
        busy = [w for w in threads if w is not None and w.busy()]
        if busy:
            wait_for_worker(busy[0])
    return svc.step()


def until_idle(svc: Service) -> list[Out]:
    """Steps until the service has no work left; every message out."""
    out: list[Out] = []
    while svc.has_work():
        out += step(svc)
    return out
