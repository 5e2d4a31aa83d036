"""Speech decoding off the engine loop: one thread (and, on a GPU, its own CUDA stream) turns answers' codes
into PCM while the language model keeps stepping.

The engine loop hands over codes as they are sampled (`push`) and collects PCM as it comes (`take_results`);
it never waits for the codec. The worker runs rounds; each decodes at most one 5-code chunk per answer, in one
batch (`CodecDecoder.run_jobs`), and posts each chunk's PCM at once. Time to first audio decides the order:
- Answers that have played nothing yet get a round of their own (their first chunks only), ahead of the rest:
  in a round with every playing answer's next chunk, the first chunk took as long as the whole batch. Two
  first-chunk rounds never run back to back while a playing answer has less than URGENT_S of audio ahead.
- A playing answer's next chunk is decoded only once its audio sent is less than `ahead_s` ahead of real time
  (playback assumed to start when its first chunk is posted). Decoding further ahead would not help its
  listener; it would only make the round that a new answer's first chunk waits behind longer.
With `first_decoders` (lanes of the decoder: CodecDecoder.lane, graphs of their own) a thread per lane decodes the
first chunks on it, at the same time as the rounds of playing answers: a new answer's first chunk no longer waits
for the round in flight (H200, 28-60 sessions: that wait was p50 27 / p95 78 ms of TTFA). With two lanes or more, a
new answer whose first chunk is ready while another's round is in flight takes a free lane instead of waiting for
that round (or for a coalesced one). Each answer is decoded by one thread at a time: a first-chunk thread until its
first chunk is posted, then the playing one.
A decoder stream is only touched by these threads once handed over. On the GPU two rounds at once share the SMs
and slow the language model's steps that a new answer waits for, so a round of playing answers yields: between the
pieces of its GPU work (CodecDecoder.run_jobs' `between`: the flow's encoder, each piece of its solve) it keeps at
most one piece queued ahead of the GPU, and pauses while any answer waits for its first codes or its first chunk:
at most BULK_HOLD_S per round, never when one of its answers has less than URGENT_S of audio ahead, and not while
another answer with that little ahead waits for the thread. (Rounds pausing down to 0.4 s of audio ahead measured no
better on TTFA, with 1-3 underruns at 76-108 sessions on an H200: docs/PERF_NOTES.md, session 13.)
With a period (`period_s`; the engine process's default with a first lane: 200 ms) rounds of playing answers do not
run back to back: one starts at most once a period, sooner only for an answer about to run dry (DRY_S), and takes every
answer due before the next could start. The same audio then goes in ~6 rounds a second of ~27 answers instead of ~16
of ~10 (H200, 132 sessions; the codec threads busy ~100% instead of ~145%): the codec's per-round cost is paid a third
as often, and the language model's steps beside it are shorter (a new answer's first row -> 8th code p50 64 -> 52 ms).
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.cuda.streams import driver_stream
from engines.process.observe.spans import Spans
from engines.process.worker_wait import wait_for_work

log = logging.getLogger("engines.process")

# Audio a playing answer is kept ahead of real time: margin for a round or two of new answers' first chunks
# and the network, without decoding far ahead of what anyone can hear yet.
AHEAD_S = 1.6
URGENT_S = 0.8  # a playing answer with less audio than this ahead is not kept waiting by a second first-chunk round
FIRST_CHUNK_CODES = 8  # 5 codes + 3 lookahead: an answer's first chunk can be decoded
COALESCE_CODES = 2  # a new answer this many codes short of its first chunk is waited for ...
COALESCE_S = 0.02  # ... at most this long
BULK_HOLD_S = 0.15  # longest a round of playing answers waits for the language model's urgent steps
# A round of playing answers decodes at most this many (more only while more are about to run dry): a new answer's
# first chunk waits for the round in flight, so rounds are kept short (H200, 12-28 sessions: that wait was the
# largest part of p95 TTFA, 101 ms, behind rounds of ~75 ms).
BULK_MAX = 8
FIRST_MAX = 16  # most first chunks in one round on the first-chunk lane (its graphs are captured up to this)
# With a first lane, a full chunk's solve in rounds of playing answers runs in this many pieces (FlowModel.solve_parts),
# so that a round yields within ~a piece: a solve on an H200 takes 11 ms at 1 session, ~25 ms at 16.
PLAYING_SOLVE_PARTS = 5
# With a period for rounds of playing answers: one starts sooner for an answer with less than this much audio ahead,
# about what a round takes under load (H200, 132 sessions: ~100 ms, up to ~160). A new answer's second chunk is due
# 0.36 s after its first, so with 0.12 s here and a 200 ms period some came late (2 underruns in 264 turns).
DRY_S = 0.2


@dataclass(eq=False)
class _Answer:
    key: Any  # the caller's handle for this answer (returned with its results)
    stream: Any  # engines.speech_out.DecodeStream
    since: float  # when its first codes arrived (round order among answers in the same state)
    new_codes: list[int] = field(default_factory=list)  # pushed, not yet given to the stream
    jobs: deque = field(default_factory=deque)  # chunks ready to decode, in order
    first_post: float | None = None  # when its first chunk was posted (its playback is assumed to start then)
    audio_s: float = 0.0  # seconds of audio posted
    codes_in: int = 0  # codes pushed
    final: bool = False  # no more codes: finish the stream after its last chunk
    finishing: bool = False  # the stream's last jobs were taken
    cancelled: bool = False  # decode nothing more; close the stream
    closed: bool = False
    busy: bool = False  # taken by a round in flight (with two threads, the other leaves it alone)


@dataclass
class _Yield:
    """A round of playing answers yielding to new answers (CodecWorker._yield_point)."""

    paused_s: float = 0.0  # paused so far (at most BULK_HOLD_S)
    queued: Any = None  # CUDA event after the piece queued before the last one


class CodecWorker:
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
        self._answers: dict[int, _Answer] = {}  # id(key) -> answer with work left
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

    @property
    def first_in_flight(self) -> bool:
        """A first-chunk round is on the GPU (read by the engine loop: it skips steps that are not urgent)."""
        return bool(self._first_flying)

    # ---- engine-loop side ----------------------------------------------------------------

    def push(self, key: Any, stream: Any, codes: list[int], final: bool = False) -> None:
        """More codes of an answer (`final`: its last ones; a result with final=True then ends it)."""
        with self._cv:
            a = self._answers.get(id(key))
            if a is None:
                a = self._answers[id(key)] = _Answer(key, stream, time.monotonic())
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

    # ---- worker side ---------------------------------------------------------------------

    def _coalesce(self, first: list[_Answer], now: float) -> bool:
        """Hold a first-chunk round (at most COALESCE_S) while another new answer is a code or two short of its
        first chunk and no other lane is free for it: sessions answering at once get their 8th codes a step or so
        apart, and a round for each in turn made the last one wait for all the others' rounds."""
        with self._cv:  # the engine loop adds answers meanwhile
            if len(self._first_flying) + 1 < len(self.first_decoders):
                return False  # another lane is free: the near answer gets a round of its own there at once
            near = any(a.first_post is None and not a.cancelled and a not in first
                       and FIRST_CHUNK_CODES - COALESCE_CODES <= a.codes_in < FIRST_CHUNK_CODES
                       for a in self._answers.values())
        if not near:
            self._coalesce_since = None
            return False
        self._coalesce_since = self._coalesce_since or now
        if now - self._coalesce_since < COALESCE_S:
            return True
        self._coalesce_since = None
        return False

    @staticmethod
    def _ahead_falls_to(a: _Answer, s: float) -> float:
        """When a playing answer's audio posted is only `s` seconds ahead of real time (playback assumed to start
        when its first chunk was posted)."""
        return a.first_post + a.audio_s - s

    def _due_at(self, a: _Answer) -> float:
        """When this answer's next chunk should be decoded (now for an answer that has played nothing)."""
        if a.first_post is None:
            return float("-inf")
        return self._ahead_falls_to(a, self.ahead_s)

    @classmethod
    def _urgent(cls, a: _Answer, now: float) -> bool:
        """A playing answer about to run dry: less than URGENT_S of its audio ahead of real time."""
        return cls._ahead_falls_to(a, URGENT_S) <= now

    def _has_work(self, a: _Answer, now: float) -> bool:
        if a.cancelled:
            return not a.closed or (a.final and not a.finishing)
        return bool(a.new_codes or (a.jobs and self._due_at(a) <= now) or (a.final and not a.finishing))

    def _mine(self, a: _Answer, kind: str) -> bool:
        """Whether a thread running rounds of `kind` may take this answer now."""
        if a.busy:
            return False
        return kind == "all" or (a.first_post is None) == (kind == "first")

    def _periodic(self, kind: str) -> bool:
        """Rounds of `kind` start at most once a period (`period_s`)."""
        return kind == "playing" and self.period_s > 0

    def _gated(self, kind: str, now: float) -> bool:
        """Rounds of `kind` wait for their period to pass since the last one began."""
        return self._periodic(kind) and now < self._playing_started + self.period_s

    def _dry_at(self, a: _Answer) -> float:
        """When a playing answer with chunks to come (or its last one to finish) gets down to DRY_S of audio ahead
        (inf: nothing to decode)."""
        if a.first_post is None or a.cancelled or not (a.jobs or a.new_codes or (a.final and not a.finishing)):
            return math.inf
        return self._ahead_falls_to(a, DRY_S)

    def _with_work(self, kind: str, now: float) -> list[_Answer] | None:
        """The answers a thread running rounds of `kind` has work for now, if any."""
        answers = [a for a in self._answers.values() if self._mine(a, kind) and self._has_work(a, now)]
        if answers and self._gated(kind, now) and all(self._dry_at(a) > now for a in answers):
            return None  # within the period, and nobody about to run dry
        return answers or None

    def _next_due(self, kind: str, now: float) -> float:
        """When the next chunk held for real time falls due among the answers of `kind` (inf: none is held), or,
        within a period of rounds, when the period ends or an answer is about to run dry."""
        mine = [a for a in self._answers.values() if self._mine(a, kind)]
        due = min((self._due_at(a) for a in mine if a.jobs and not a.cancelled), default=math.inf)
        if not self._gated(kind, now):
            return due
        return min(max(due, self._playing_started + self.period_s), min(map(self._dry_at, mine), default=math.inf))

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
            released: list[_Answer] = []  # taken answers the round let go of before it ended
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
    def _end_failed(cls, a: _Answer, e: Exception, posts: list, done: list[_Answer]) -> None:
        """End an answer with `e` (its decoder failed, or its round did): no more jobs, its stream closed (its state is
        unknown), the error posted as its final result."""
        a.jobs.clear()
        with contextlib.suppress(Exception):
            cls._close_stream(a)
        posts.append((a.key, e, True))
        done.append(a)

    @staticmethod
    def _close_stream(a: _Answer) -> None:
        """Close the answer's decoder stream, once (a cancelled answer's, its last chunk's, or after a failed round)."""
        if not a.closed and hasattr(a.stream, "close"):
            a.stream.close()
        a.closed = True

    def _pause_wanted(self) -> bool:
        """An answer waits for its first codes or its first chunk (or a first-chunk round is on the GPU), and no
        playing answer outside the round (a paused round holds its thread) has work and less than URGENT_S ahead."""
        with self._cv:  # the engine loop adds answers meanwhile
            now = self._clock()
            waits = self.lm_ramping or self.first_in_flight
            for a in self._answers.values():
                if a.cancelled:
                    continue
                if a.first_post is None:
                    waits = True
                elif not a.busy and (a.jobs or a.new_codes) and self._urgent(a, now):
                    return False
            return waits

    def _yield_point(self, y: _Yield) -> None:
        """Between two pieces of a playing round's GPU work (module doc): wait until the GPU has at most the piece
        just queued left, then pause while a new answer waits, up to BULK_HOLD_S in all for the round."""
        if self._stream is not None:
            ev = torch.cuda.Event()
            ev.record()
            before, y.queued = y.queued, ev
            if before is not None:
                before.synchronize()  # (releases the GIL)
        while y.paused_s < BULK_HOLD_S and not self._closed and self._pause_wanted():
            t0 = time.monotonic()
            time.sleep(0.001)
            y.paused_s += time.monotonic() - t0

    def _round(self, taken: list[tuple[_Answer, list[int], bool]], kind: str, decoder: Any, released: list[_Answer]
               ) -> tuple[list, list[_Answer], int, bool]:
        """Give new codes to their streams, then decode one ready chunk of each answer that has played nothing
        (if any has one ready), else of each playing answer whose next chunk is due (with a first lane, each thread
        only has answers of its own kind). The taken answers outside the batch are let go of (appended to
        `released`) before the decode, so another lane can take one whose first chunk becomes ready meanwhile.
        Returns (posts, answers done, chunks decoded, whether first chunks)."""
        posts: list[tuple[Any, np.ndarray | Exception, bool]] = []
        done: list[_Answer] = []
        ready: list[_Answer] = []
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
            except Exception as e:  # noqa: BLE001 - bad codes or a broken stream end this answer only
                posts.append((a.key, e, True))
                done.append(a)
        now = self._clock()
        first = sorted((a for a in ready if a.first_post is None), key=lambda a: a.since)
        # With a period, a round takes every answer that falls due before the next one can start.
        horizon = now + (self.period_s if self._periodic(kind) else 0.0)
        due = sorted((a for a in ready if a.first_post is not None and self._due_at(a) <= horizon), key=self._due_at)
        # First chunks first, but never two such rounds in a row while a playing answer is about to run dry.
        # `due` is in due order, so the answers about to run dry are its first n_urgent.
        n_urgent = sum(1 for a in due if self._urgent(a, now))
        urgent = n_urgent > 0
        take_first = bool(first) and not (self._after_first and urgent)
        if take_first:
            batch = first
        elif self._periodic(kind):
            batch = due  # every answer due before the next round (the period bounds how many rounds, not this)
        else:
            batch = due[: max(self.bulk_max, n_urgent)]
        if batch and take_first and self._coalesce(first, now):
            return posts, done, -1, True  # another answer's first chunk is a step or two away: one round for both
        if batch and not take_first and self.lm_ramping and not urgent:
            self._held_since = self._held_since or now
            if now - self._held_since < BULK_HOLD_S:
                return posts, done, -1, False  # the language model's urgent steps go first
        self._held_since = None
        if kind == "all":
            self._after_first = take_first
        batch = batch[: self.first_max if kind == "first" else self.max_batch]
        if batch:
            with self._cv:
                for a, _, _ in taken:
                    if a not in batch and a not in done:
                        a.busy = False
                        released.append(a)
            if self._periodic(kind):
                self._playing_started = now
            jobs = [a.jobs.popleft() for a in batch]
            # The one thread runs first chunks on the urgent stream; a first lane's thread is on it already.
            fast = self._first_stream if take_first and kind == "all" else None
            if take_first:
                with self._cv:
                    self._first_flying.add(threading.get_ident())
            y = _Yield() if kind == "playing" and not urgent else None
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
            for a, job, pcm in zip(batch, jobs, pcms, strict=True):
                a.first_post = posted if a.first_post is None else a.first_post
                a.audio_s += len(pcm) / self.sample_rate
                posts.append((a.key, pcm, job.final))
                if job.final:
                    self._close_stream(a)
                    done.append(a)
        return posts, done, len(batch), take_first
