"""Speech decoding off the engine loop: one thread (and, on a GPU, its own CUDA stream) turns answers' codes
into PCM while the language model keeps stepping.

The engine loop hands over codes as they are sampled (`push`) and collects PCM as it comes (`take_results`);
it never waits for the codec. The worker runs rounds; each decodes at most one 5-code chunk per answer, in one
batch (`CodecDecoder.run_jobs`), and posts each chunk's PCM at once. Which answers a round takes, and when, and how a
round of playing answers yields to new ones: codec_pacing.py.
With `first_decoders` (lanes of the decoder: CodecDecoder.lane, graphs of their own) a thread per lane decodes the
first chunks on it, at the same time as the rounds of playing answers: a new answer's first chunk does not wait
for the round in flight (without lanes, H200, 28-60 sessions, that wait is p50 27 / p95 78 ms of TTFA). With two
lanes or more, a new answer whose first chunk is ready while another's round is in flight takes a free lane instead
of waiting for that round (or for a coalesced one). Each answer is decoded by one thread at a time: a first-chunk
thread until its first chunk is posted, then the playing one.
A decoder stream is only touched by these threads once handed over.
A decoder failure ends the answers of its batch; any other error in a round ends that round's answers, and the thread
goes on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engines.cuda.streams import driver_stream
from engines.process.codec_pacing import AHEAD_S, BULK_MAX, FIRST_MAX, CodecAnswer, CodecPacing, RoundYield
from engines.process.observe.spans import Spans
from engines.process.worker_wait import wait_for_work

log = logging.getLogger("engines.process")

class CodecWorker(CodecPacing):
    """`decoder` batches chunks of many streams: `run_jobs(jobs) -> PCM per job` (engines.speech_out)."""

    def __init__(self, decoder: Any, device: torch.device, max_batch: int = 256, ahead_s: float = AHEAD_S,
                 clock: Any = time.monotonic, bulk_max: int = BULK_MAX, first_decoders: Sequence[Any] = (),
                 first_max: int = FIRST_MAX, period_s: float = 0.0) -> None:
        """`first_decoders`: lanes of `decoder` for first chunks, each on a thread of its own (module doc);
        at most `first_max` per round there. `period_s` (with first lanes): rounds of playing answers start at most
        this often (sooner only for an answer about to run dry, DRY_S), each with every answer due before the next
        one, instead of back to back with at most `bulk_max`: fewer, larger rounds for the same audio."""
        self.decoder = decoder
        self.first_decoders = list(first_decoders)
        self.first_max = first_max
        self.max_batch = max_batch
        self.bulk_max = bulk_max
        self.ahead_s = ahead_s
        self.period_s = period_s if self.first_decoders else 0.0
        self._playing_started = -math.inf  # when the last round of playing answers began decoding
        self.sample_rate = getattr(decoder, "sample_rate", 24000)
        self._clock = clock
        self._after_first = False  # the last round decoded first chunks
        # Set by the engine loop: an answer waits for its first codes (rounds of playing answers wait, or with a
        # first lane pause, at most BULK_HOLD_S).
        self.lm_ramping = False
        self._first_flying: set[int] = set()  # threads (idents) with a first-chunk round on the GPU
        self._held_since: float | None = None
        self._coalesce_since: float | None = None
        # Rounds of playing answers' chunks run at the lowest stream priority, below the language model's steps;
        # first-chunk rounds at the highest, level with them: a new answer's first audio waits on both.
        self._stream = self._first_stream = None
        self._lane_streams: list[Any] = [None] * len(self.first_decoders)
        if device.type == "cuda":
            self._stream = driver_stream(device)
            self._first_stream = driver_stream(device, urgent=True)
            self._lane_streams = [self._first_stream] + [driver_stream(device, urgent=True)
                                                         for _ in self.first_decoders[1:]]
        self._cv = threading.Condition()
        self._answers: dict[int, CodecAnswer] = {}  # id(key) -> answer with work left
        self._results: deque[tuple[Any, np.ndarray | Exception, bool]] = deque()
        self._running = 0  # rounds in flight
        self._closed = False
        self.batches = 0  # counters for the engine process's load log
        self.items = 0
        self.busy_s = 0.0
        self.spans = Spans()  # round times, taken by the load log (under _cv)
        self._first_rounds: dict[int, tuple[float, float]] = {}  # id(key) -> its first chunk's round (start, end)
        # (kind, lane): "all" (one thread for every round), or a "first" thread per lane and one "playing" thread
        runs = ([("first", i) for i in range(len(self.first_decoders))] + [("playing", 0)] if self.first_decoders
                else [("all", 0)])
        self._threads = [threading.Thread(target=self._run, args=(k, i), daemon=True,
                                          name=f"codec-worker-{k}" + (f"-{i + 1}" if i else ""))
                         for k, i in runs]
        for t in self._threads:
            t.start()

    @property
    def first_decoder(self) -> Any:
        """The first lane (None without lanes)."""
        return self.first_decoders[0] if self.first_decoders else None

    # ---- engine-loop side ----------------------------------------------------------------

    def push(self, key: Any, stream: Any, codes: list[int], final: bool = False) -> None:
        """More codes of an answer (`final`: its last ones; a result with final=True then ends it)."""
        with self._cv:
            a = self._answers.get(id(key))
            if a is None:
                a = self._answers[id(key)] = CodecAnswer(key, stream, time.monotonic())
            a.new_codes += codes
            a.codes_in += len(codes)
            a.final = a.final or final
            self._cv.notify_all()

    def cancel(self, key: Any) -> None:
        """Decode no more of this answer (its final result, if pushed, still comes, empty)."""
        with self._cv:
            a = self._answers.get(id(key))
            if a is not None:
                a.cancelled = True
                self._cv.notify_all()

    def take_results(self, audio_only: bool = False) -> list[tuple[Any, np.ndarray | Exception, bool]]:
        """(key, PCM or the decoder's exception, final) in the order they were produced. `audio_only`: only the
        leading results that are PCM and not an answer's last (what the engine loop can send in the middle of a
        step, Service.while_stepping); the rest stay, in order."""
        with self._cv:
            if not audio_only:
                out = list(self._results)
                self._results.clear()
                return out
            out = []
            while self._results and isinstance(self._results[0][1], np.ndarray) and not self._results[0][2]:
                out.append(self._results.popleft())
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
            return bool(self._answers) or self._running > 0 or bool(self._results)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    def _run(self, kind: str, lane: int) -> None:
        """Rounds of `kind`: "all" (the one thread), or "first" (on first lane `lane`) / "playing" (with lanes)."""
        decoder = self.first_decoders[lane] if kind == "first" else self.decoder
        stream = self._lane_streams[lane] if kind == "first" else self._stream
        while True:
            with self._cv:
                answers = wait_for_work(self._cv, lambda: self._closed, lambda now: self._with_work(kind, now),
                                        lambda now: self._next_due(kind, now), self._clock, 0.001)
                if answers is None:
                    return
                taken = [(a, a.new_codes, a.final and not a.finishing) for a in answers]
                for a in answers:
                    a.new_codes = []
                    a.finishing = a.finishing or a.final
                    a.busy = True
                self._running += 1
            t0, started, cpu0 = time.perf_counter(), time.monotonic(), time.thread_time()
            new = [a for a, _, _ in taken if a.first_post is None]
            decoded, first = 0, False
            released: list[CodecAnswer] = []  # taken answers the round let go of before it ended
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    posts, done, decoded, first = self._round(taken, kind, decoder, released)
            except Exception as e:  # noqa: BLE001 - outside the decoder's own failures (handed back by _round):
                # the thread must live on, or every answer would wait for it; this round's answers end with `e`
                log.exception("codec worker: unexpected error in a round; its %d answer(s) fail", len(taken))
                posts, done = [], []
                for a, _, _ in taken:
                    if a not in released:  # (a released one may be another lane's by now)
                        self._end_failed(a, e, posts, done)
            finally:
                with self._cv:
                    dt = time.perf_counter() - t0
                    self.busy_s += dt
                    if decoded > 0:
                        self.batches += 1
                        self.items += decoded
                        name = "codec round" + (" (first chunks)" if first else "")
                        self.spans.add(name, dt)
                        # What the round's wall time was made of: this thread's CPU time, and the wait for the GPU
                        # to finish it; the rest went waiting for the GIL.
                        self.spans.add(name + " cpu", time.thread_time() - cpu0)
                        self.spans.add(name + " gpu wait", getattr(decoder, "last_gpu_wait_s", 0.0))
                    for a in new:
                        if a.first_post is not None and a not in released:
                            self._first_rounds[id(a.key)] = (started, time.monotonic())
                    self._results.extend(posts)
                    for a in done:
                        self._answers.pop(id(a.key), None)
                    for a, _, _ in taken:
                        if a not in released:  # (a released one may be another thread's by now)
                            a.busy = False
                    # (marked by _round) cleared once its PCM is posted, not before
                    self._first_flying.discard(threading.get_ident())
                    self._running -= 1
                    self._cv.notify_all()
            if decoded < 0:  # held back for the language model: look again shortly (it sets no event)
                time.sleep(0.002)

    @classmethod
    def _end_failed(cls, a: CodecAnswer, e: Exception, posts: list, done: list[CodecAnswer]) -> None:
        """End an answer with `e` (its decoder failed, or its round did): no more jobs, its stream closed (its state is
        unknown), the error posted as its final result."""
        a.jobs.clear()
        with contextlib.suppress(Exception):
            cls._close_stream(a)
        posts.append((a.key, e, True))
        done.append(a)

    @staticmethod
    def _close_stream(a: CodecAnswer) -> None:
        """Close the answer's decoder stream, once (a cancelled answer's, its last chunk's, or after a failed round)."""
        if not a.closed and hasattr(a.stream, "close"):
            a.stream.close()
        a.closed = True

    def _yield_point(self, y: RoundYield) -> None:
        """Between two pieces of a playing round's GPU work (codec_pacing.py): wait until the GPU has at most the piece
        just queued left, then pause while a new answer waits (CodecPacing._pause)."""
        if self._stream is not None:
            ev = torch.cuda.Event()
            ev.record()
            before, y.queued = y.queued, ev
            if before is not None:
                before.synchronize()  # (releases the GIL)
        self._pause(y)

    def _round(self, taken: list[tuple[CodecAnswer, list[int], bool]], kind: str, decoder: Any,
               released: list[CodecAnswer]) -> tuple[list, list[CodecAnswer], int, bool]:
        """Give new codes to their streams, then decode the batch CodecPacing._pick makes of the answers with a chunk
        ready (with a first lane, each thread only has answers of its own kind). The taken answers outside the batch
        are let go of (appended to `released`) before the decode, so another lane can take one whose first chunk
        becomes ready meanwhile.
        Returns (posts, answers done, chunks decoded, whether first chunks)."""
        posts: list[tuple[Any, np.ndarray | Exception, bool]] = []
        done: list[CodecAnswer] = []
        ready: list[CodecAnswer] = []
        for a, codes, finishing in taken:
            try:
                if a.cancelled:
                    a.jobs.clear()
                    self._close_stream(a)
                    if a.final:
                        posts.append((a.key, np.zeros(0, np.float32), True))
                        done.append(a)
                    continue
                if codes:
                    a.stream.add(codes)
                a.jobs.extend(a.stream.take_jobs(finishing=finishing))
                if a.jobs:
                    ready.append(a)
            except Exception as e:  # noqa: BLE001 - bad codes, a broken stream or a full decoder cache end this
                # answer only; its stream is closed (what it holds goes back), so codes pushed after fail at once
                self._end_failed(a, e, posts, done)
        batch, take_first, urgent = self._pick(ready, kind)
        if batch is None:
            return posts, done, -1, take_first  # held back (CodecPacing._pick)
        decoded = 0  # chunks decoded (the load log's count)
        if batch:
            with self._cv:
                for a, _, _ in taken:
                    if a not in batch and a not in done:
                        a.busy = False
                        released.append(a)
            jobs = [a.jobs.popleft() for a in batch]
            # The one thread runs first chunks on the urgent stream; a first lane's thread is on it already.
            fast = self._first_stream if take_first and kind == "all" else None
            if take_first:
                with self._cv:
                    self._first_flying.add(threading.get_ident())
            y = RoundYield() if kind == "playing" and not urgent else None
            try:
                with torch.cuda.stream(fast) if fast is not None else contextlib.nullcontext():
                    pcms = decoder.run_jobs(jobs, between=(lambda: self._yield_point(y)) if y is not None else None)
            except Exception as e:  # noqa: BLE001 - handed back: the Service fails those answers
                for a in batch:
                    self._end_failed(a, e, posts, done)
                return posts, done, 0, take_first
            finally:
                if y is not None and y.paused_s > 0:
                    with self._cv:
                        self.spans.add("codec round paused", y.paused_s)
            posted = self._clock()
            decoded = sum(not isinstance(pcm, Exception) for pcm in pcms)
            for a, job, pcm in zip(batch, jobs, pcms, strict=True):
                if isinstance(pcm, Exception):  # its chunk found no page in the decoder's cache: this answer ends
                    self._end_failed(a, pcm, posts, done)
                    continue
                a.first_post = posted if a.first_post is None else a.first_post
                a.audio_s += len(pcm) / self.sample_rate
                posts.append((a.key, pcm, job.final))
                if job.final:
                    self._close_stream(a)
                    done.append(a)
        return posts, done, decoded, take_first
