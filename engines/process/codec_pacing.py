"""Which answers a round of the codec worker (codec_worker.py) decodes, and when: time to first audio decides.

- Answers that have played nothing yet get a round of their own (their first chunks only), ahead of the rest:
  in a round with every playing answer's next chunk, the first chunk took as long as the whole batch. Two
  first-chunk rounds never run back to back while a playing answer has less than URGENT_S of audio ahead.
- A playing answer's next chunk is decoded only once its audio sent is less than `ahead_s` ahead of real time
  (playback assumed to start when its first chunk is posted). Decoding further ahead would not help its
  listener; it would only make the round that a new answer's first chunk waits behind longer.
- A first-chunk round waits briefly (COALESCE_S) for another new answer a code or two short of its first chunk
  when no other first lane is free for it.
On the GPU two rounds at once share the SMs and slow the language model's steps that a new answer waits for, so a
round of playing answers yields: between the pieces of its GPU work (CodecDecoder.run_jobs' `between`: the flow's
encoder, each piece of its solve) it keeps at most one piece queued ahead of the GPU, and pauses while any answer waits
for its first codes or its first chunk: at most BULK_HOLD_S per round, never when one of its answers has less than
URGENT_S of audio ahead, and not while another answer with that little ahead waits for the thread. (Pausing rounds
down to 0.4 s of audio ahead gained no TTFA and cost 1-3 underruns at 76-108 sessions on an H200, 2026-11-23.)
With a period (`period_s`; the engine process's default with a first lane: 200 ms) rounds of playing answers do not
run back to back: one starts at most once a period, sooner only for an answer about to run dry (DRY_S), and takes every
answer due before the next could start. The same audio then goes in ~6 rounds a second of ~27 answers instead of ~16
of ~10 (H200, 132 sessions; the codec threads busy ~100% instead of ~145%): the codec's per-round cost is paid a third
as often, and the language model's steps beside it are shorter (a new answer's first row -> 8th code p50 64 -> 52 ms).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Audio a playing answer is kept ahead of real time: margin for a round or two of new answers' first chunks
# and the network, without decoding far ahead of what anyone can hear yet.
AHEAD_S = 1.6
URGENT_S = 0.8  # a playing answer with less audio than this ahead is not kept waiting by a second first-chunk round
COALESCE_CODES = 2  # a new answer this many codes short of its first audio's (stream.first_audio_codes) is waited for
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
class CodecAnswer:
    """An answer as the codec worker holds it."""

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
class RoundYield:
    """A round of playing answers yielding to new answers (CodecWorker._yield_point, CodecPacing._pause)."""

    paused_s: float = 0.0  # paused so far (at most BULK_HOLD_S)
    queued: Any = None  # CUDA event after the piece queued before the last one

class CodecPacing:
    """The codec worker's round planning (module doc). Part of CodecWorker, which sets this state (its __init__) and
    holds `_cv` while it reads `_answers` across threads."""

    ahead_s: float
    bulk_max: int
    first_max: int
    max_batch: int
    period_s: float
    first_decoders: list[Any]
    lm_ramping: bool  # set by the engine loop: an answer waits for its first codes
    _clock: Any
    _cv: threading.Condition
    _closed: bool
    _answers: dict[int, CodecAnswer]
    _first_flying: set[int]
    _playing_started: float
    _after_first: bool
    _held_since: float | None
    _coalesce_since: float | None

    @property
    def first_in_flight(self) -> bool:
        """A first-chunk round is on the GPU (read by the engine loop: it skips steps that are not urgent)."""
        return bool(self._first_flying)

    def _coalesce(self, first: list[CodecAnswer], now: float) -> bool:
        """Hold a first-chunk round (at most COALESCE_S) while another new answer is a code or two short of its
        first audio's and no other lane is free for it: sessions answering at once get those codes a step or so
        apart, and a round for each in turn made the last one wait for all the others' rounds."""
        with self._cv:  # the engine loop adds answers meanwhile
            if len(self._first_flying) + 1 < len(self.first_decoders):
                return False  # another lane is free: the near answer gets a round of its own there at once
            near = any(a.first_post is None and not a.cancelled and a not in first
                       and a.stream.first_audio_codes - COALESCE_CODES <= a.codes_in < a.stream.first_audio_codes
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
    def _ahead_falls_to(a: CodecAnswer, s: float) -> float:
        """When a playing answer's audio posted is only `s` seconds ahead of real time (playback assumed to start
        when its first chunk was posted)."""
        return a.first_post + a.audio_s - s

    def _due_at(self, a: CodecAnswer) -> float:
        """When this answer's next chunk should be decoded (now for an answer that has played nothing)."""
        if a.first_post is None:
            return float("-inf")
        return self._ahead_falls_to(a, self.ahead_s)

    @classmethod
    def _urgent(cls, a: CodecAnswer, now: float) -> bool:
        """A playing answer about to run dry: less than URGENT_S of its audio ahead of real time."""
        return cls._ahead_falls_to(a, URGENT_S) <= now

    @staticmethod
    def _ending(a: CodecAnswer) -> bool:
        """A cancelled answer with its stream still to close or its end still to post: no decoding, and its
        ResponseDone (which the session's next inputs wait for) waits on it."""
        return a.cancelled and (not a.closed or (a.final and not a.finishing))

    def _has_work(self, a: CodecAnswer, now: float) -> bool:
        if a.cancelled:
            return self._ending(a)
        return bool(a.new_codes or (a.jobs and self._due_at(a) <= now) or (a.final and not a.finishing))

    def _mine(self, a: CodecAnswer, kind: str) -> bool:
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

    def _dry_at(self, a: CodecAnswer) -> float:
        """When a playing answer with chunks to come (or its last one to finish) gets down to DRY_S of audio ahead
        (inf: nothing to decode; -inf: a cancelled answer to end, never held for a period)."""
        if self._ending(a):
            return -math.inf
        if a.first_post is None or a.cancelled or not (a.jobs or a.new_codes or (a.final and not a.finishing)):
            return math.inf
        return self._ahead_falls_to(a, DRY_S)

    def _with_work(self, kind: str, now: float) -> list[CodecAnswer] | None:
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

    def _pause(self, y: RoundYield) -> None:
        """Between two pieces of a playing round's GPU work: pause while a new answer waits, up to BULK_HOLD_S in all
        for the round."""
        while y.paused_s < BULK_HOLD_S and not self._closed and self._pause_wanted():
            t0 = time.monotonic()
            time.sleep(0.001)
            y.paused_s += time.monotonic() - t0

    def _pick(self, ready: list[CodecAnswer], kind: str) -> tuple[list[CodecAnswer] | None, bool, bool]:
        """Which of the answers with a chunk ready a round of `kind` decodes: one ready chunk of each answer that has
        played nothing (if any has one ready), else of each playing answer whose next chunk is due. Returns (the
        batch, or None to hold the round back and look again shortly; whether it is first chunks; whether a playing
        answer is about to run dry)."""
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
            return None, True, urgent  # another answer's first chunk is a step or two away: one round for both
        if batch and not take_first and self.lm_ramping and not urgent:
            self._held_since = self._held_since or now
            if now - self._held_since < BULK_HOLD_S:
                return None, False, urgent  # the language model's urgent steps go first
        self._held_since = None
        if kind == "all":
            self._after_first = take_first
        batch = batch[: self.first_max if kind == "first" else self.max_batch]
        if batch and self._periodic(kind):
            self._playing_started = now
        return batch, take_first, urgent
