"""Speech decoding off the engine loop: one thread (and, on a GPU, its own CUDA stream) turns answers' codes
into PCM while the language model keeps stepping.

The engine loop hands over codes as they are sampled (`push`) and collects PCM as it comes (`take_results`);
it never waits for the codec. The worker runs rounds: each round decodes at most one 5-code chunk of every
answer that has one ready, in one batch (`CodecDecoder.run_jobs`), and posts each chunk's PCM at once, so an
answer's audio flows chunk by chunk however far the language model is ahead. Answers that have not played
anything yet go first. A decoder stream is only touched by this thread once handed over.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.service.spans import Spans


@dataclass(eq=False)
class _Answer:
    key: Any  # the caller's handle for this answer (returned with its results)
    stream: Any  # engines.codec.decoder.DecodeStream
    since: float  # when its first codes arrived (round order among answers in the same state)
    new_codes: list[int] = field(default_factory=list)  # pushed, not yet given to the stream
    jobs: deque = field(default_factory=deque)  # chunks ready to decode, in order
    final: bool = False  # no more codes: finish the stream after its last chunk
    finishing: bool = False  # the stream's last jobs were taken
    cancelled: bool = False  # decode nothing more; close the stream
    closed: bool = False
    chunks_out: int = 0


class CodecWorker:
    """`decoder` batches chunks of many streams: `run_jobs(jobs) -> PCM per job` (engines.codec.decoder)."""

    def __init__(self, decoder: Any, device: torch.device, max_batch: int = 256) -> None:
        self.decoder = decoder
        self.max_batch = max_batch
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cv = threading.Condition()
        self._answers: dict[int, _Answer] = {}  # id(key) -> answer with work left
        self._results: deque[tuple[Any, np.ndarray | Exception, bool]] = deque()
        self._running = False
        self._closed = False
        self.batches = 0  # counters for the engine process's load log
        self.items = 0
        self.busy_s = 0.0
        self.spans = Spans()  # round times, taken by the load log (under _cv)
        self._first_rounds: dict[int, tuple[float, float]] = {}  # id(key) -> its first chunk's round (start, end)
        self._thread = threading.Thread(target=self._run, name="codec-worker", daemon=True)
        self._thread.start()

    # ---- engine-loop side ----------------------------------------------------------------

    def push(self, key: Any, stream: Any, codes: list[int], final: bool = False) -> None:
        """More codes of an answer (`final`: its last ones; a result with final=True then ends it)."""
        with self._cv:
            a = self._answers.get(id(key))
            if a is None:
                a = self._answers[id(key)] = _Answer(key, stream, time.monotonic())
            a.new_codes += codes
            a.final = a.final or final
            self._cv.notify_all()

    def cancel(self, key: Any) -> None:
        """Decode no more of this answer (its final result, if pushed, still comes, empty)."""
        with self._cv:
            a = self._answers.get(id(key))
            if a is not None:
                a.cancelled = True
                self._cv.notify_all()

    def take_results(self) -> list[tuple[Any, np.ndarray | Exception, bool]]:
        """(key, PCM or the decoder's exception, final) in the order they were produced."""
        with self._cv:
            out = list(self._results)
            self._results.clear()
            return out

    def first_chunk_round(self, key: Any) -> tuple[float, float] | None:
        """(start, end) in time.monotonic() of the round that decoded this answer's first chunk, once."""
        with self._cv:
            return self._first_rounds.pop(id(key), None)

    def take_spans(self) -> dict[str, tuple[int, float, float]]:
        with self._cv:
            return self.spans.take()

    def busy(self) -> bool:
        """Answers with work left, a round running, or results not yet collected."""
        with self._cv:
            return bool(self._answers) or self._running or bool(self._results)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    # ---- worker side ---------------------------------------------------------------------

    @staticmethod
    def _has_work(a: _Answer) -> bool:
        if a.cancelled:
            return not a.closed or (a.final and not a.finishing)
        return bool(a.new_codes or a.jobs or (a.final and not a.finishing))

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or any(self._has_work(a) for a in self._answers.values()))
                if self._closed:
                    return
                answers = [a for a in self._answers.values() if self._has_work(a)]
                taken = [(a, a.new_codes, a.final and not a.finishing) for a in answers]
                for a in answers:
                    a.new_codes = []
                    a.finishing = a.finishing or a.final
                self._running = True
            t0, started = time.perf_counter(), time.monotonic()
            new = [a for a, _, _ in taken if a.chunks_out == 0]
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        posts, done = self._round(taken)
                else:
                    posts, done = self._round(taken)
            finally:
                with self._cv:
                    dt = time.perf_counter() - t0
                    self.busy_s += dt
                    self.spans.add("codec round", dt)
                    for a in new:
                        if a.chunks_out:
                            self._first_rounds[id(a.key)] = (started, time.monotonic())
                    self._results.extend(posts)
                    for a in done:
                        self._answers.pop(id(a.key), None)
                    self._running = False
                    self._cv.notify_all()

    def _round(self, taken: list[tuple[_Answer, list[int], bool]]) -> tuple[list, list[_Answer]]:
        """Give new codes to their streams, then decode one ready chunk of each answer (new answers first)."""
        posts: list[tuple[Any, np.ndarray | Exception, bool]] = []
        done: list[_Answer] = []
        ready: list[_Answer] = []
        for a, codes, finishing in taken:
            try:
                if a.cancelled:
                    a.jobs.clear()
                    if not a.closed and hasattr(a.stream, "close"):
                        a.stream.close()
                    a.closed = True
                    if a.final:
                        posts.append((a.key, np.zeros(0, np.float32), True))
                        done.append(a)
                    continue
                if codes:
                    a.stream.add(codes)
                a.jobs.extend(a.stream.take_jobs(finishing=finishing))
                if a.jobs:
                    ready.append(a)
            except Exception as e:  # noqa: BLE001 - bad codes or a broken stream end this answer only
                posts.append((a.key, e, True))
                done.append(a)
        ready.sort(key=lambda a: (a.chunks_out > 0, a.since))
        batch = ready[: self.max_batch]
        if batch:
            jobs = [a.jobs.popleft() for a in batch]
            try:
                pcms = self.decoder.run_jobs(jobs)
            except Exception as e:  # noqa: BLE001 - handed back: the Service fails those answers
                for a in batch:
                    a.jobs.clear()
                    posts.append((a.key, e, True))
                    done.append(a)
                return posts, done
            self.batches += 1
            self.items += len(batch)
            for a, job, pcm in zip(batch, jobs, pcms, strict=True):
                a.chunks_out += 1
                posts.append((a.key, pcm, job.final))
                if job.final:
                    if hasattr(a.stream, "close"):
                        a.stream.close()
                    done.append(a)
        return posts, done
