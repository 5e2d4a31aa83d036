"""Fakes for the codec worker's tests: a stream and a decoder that record what the worker does, and waits for what
it must reach (a round reaching the decoder, a result posted, a thread going idle, a round held back or paused), so
the tests never sleep to let the worker get somewhere and see the same things on a loaded machine."""


from __future__ import annotations

import threading
import time

import numpy as np

from engines.process.codec_worker import CodecWorker
from engines.speech_out.flow.pages import DecoderCacheFull
from engines.speech_out.stream import Job

CHUNK, LOOK = 5, 3
WAIT_S = 60.0  # bound on a wait for something the worker must do: a hang fails the test instead of blocking it


class FakeStream:
    """Chunks of 5 codes once 3 lookahead codes follow; finishing takes the rest (last one final)."""

    first_audio_codes = CHUNK + LOOK

    def __init__(self, name: str) -> None:
        self.name, self.pending, self.closed = name, [], False

    def add(self, codes):
        self.pending += codes

    def take_jobs(self, finishing=False):
        jobs = []
        while len(self.pending) >= CHUNK + LOOK:
            jobs.append(Job(self, self.pending[:CHUNK], self.pending[CHUNK:CHUNK + LOOK], False))
            del self.pending[:CHUNK]
        if finishing:
            while self.pending:
                jobs.append(Job(self, self.pending[:CHUNK], [], False))
                del self.pending[:CHUNK]
            if jobs:
                jobs[-1].final = True
            else:
                jobs.append(Job(self, [], [], True))
        return jobs

    def close(self):
        self.closed = True


class Count:
    """A count that a test can wait for (threads add to it)."""

    def __init__(self) -> None:
        self.n, self._cv = 0, threading.Condition()

    def add(self) -> None:
        with self._cv:
            self.n += 1
            self._cv.notify_all()

    def wait(self, n: int = 1, what: str = "calls") -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.n >= n, WAIT_S), f"{n} {what} expected, {self.n} came"


class FakeDecoder:
    """PCM of a chunk = its codes as floats; records each batch (stream names); can be held or made to fail.
    `entered` counts the rounds that reached run_jobs (before the gate); decoders may share one."""

    sample_rate = 24000  # a chunk of 5 codes is ~0 s of "audio": every playing answer is due at once

    def __init__(self, entered: Count | None = None) -> None:
        self.batches: list[list[str]] = []
        self.entered = entered or Count()
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.full: set[str] = set()  # streams whose chunks find no page in the decoder's cache (an error in its slot)
        self.betweens: list[bool] = []  # per batch: whether the worker could pause it between pieces

    def run_jobs(self, jobs, between=None):
        self.entered.add()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.betweens.append(between is not None)
        if between is not None:  # one piece of GPU work queued, one to come
            between()
        if len({id(j.stream) for j in jobs}) != len(jobs):
            raise AssertionError("two chunks of one stream in a batch")
        self.batches.append([j.stream.name for j in jobs])
        if self.fail:
            raise RuntimeError("decoder broke")
        return [DecoderCacheFull("no page") if j.stream.name in self.full else np.asarray(j.codes, np.float32)
                for j in jobs]


def collect(worker: CodecWorker, until) -> list:
    """The worker's results as it posts them, until `until(results)` holds."""
    out = []
    deadline = time.monotonic() + WAIT_S
    while True:
        out += worker.take_results()
        if until(out):
            return out
        with worker._cv:  # (notified whenever a round ends)
            if not worker._results:
                assert worker._cv.wait(max(0.0, deadline - time.monotonic())), f"timed out; got {out}"


class Idle:
    """Whether the worker's thread of a kind is idle: it found nothing to take at its clock's now (`_with_work` gave
    None), asked when to look again (`_next_due`) and waits, having taken nothing since. A test waits for this to see
    the worker leave work alone, instead of sleeping and then looking."""

    def __init__(self, w: CodecWorker) -> None:
        self.w, self.kinds, self._cv = w, set(), threading.Condition()
        with_work, next_due = w._with_work, w._next_due

        def taking(kind, now):  # (the worker holds w._cv here and in parking)
            got = with_work(kind, now)
            if got is not None:
                with self._cv:
                    self.kinds.discard(kind)
            return got

        def parking(kind, now):
            with self._cv:
                self.kinds.add(kind)
                self._cv.notify_all()
            return next_due(kind, now)

        w._with_work, w._next_due = taking, parking

    def push(self, *args, **kw) -> None:
        """w.push; only a look at the worker's state after it counts as idle."""
        with self.w._cv:
            with self._cv:
                self.kinds.clear()
            self.w.push(*args, **kw)

    def wait(self, kind: str = "all") -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: kind in self.kinds, WAIT_S), f"the {kind} thread never went idle"


def counted(w: CodecWorker, name: str, which) -> Count:
    """Count the calls of the worker's method `name` whose result passes `which` (what the worker decided)."""
    count, real = Count(), getattr(w, name)

    def call(*a, **kw):
        out = real(*a, **kw)
        if which(out):
            count.add()
        return out

    setattr(w, name, call)
    return count


def held_rounds(w: CodecWorker) -> Count:
    """Rounds that held their batch back (`_round` decoded nothing and looks again shortly)."""
    return counted(w, "_round", lambda out: out[2] < 0)


def pauses(w: CodecWorker) -> Count:
    """Looks of a round between its pieces that found it should pause (`_pause_wanted`)."""
    return counted(w, "_pause_wanted", bool)


