"""The engine loop's stall watch names the call a long section was stuck in, and leaves short sections alone.

A section's length is read from the watch's clock, which the tests move themselves (a stall is "longer than the
threshold", not "slower than this machine"); the sections last until the watch thread has looked at them."""

import gc
import logging
import threading
import time
import types

import pytest

from engines.process.observe import stall_watch
from engines.process.observe.stall_watch import StallWatch

WAIT_S = 60.0  # bound on a wait for the watch thread: a hang fails the test instead of blocking it


class Count:
    """A count that a test can wait for (threads add to it)."""

    def __init__(self) -> None:
        self.n, self._cv = 0, threading.Condition()

    def add(self) -> None:
        with self._cv:
            self.n += 1
            self._cv.notify_all()

    def wait(self, n: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.n >= n, WAIT_S), f"{n} expected, {self.n} came"


class Clock:
    """The watch module's `time.perf_counter`: the real one, or (`fake`) a time the test moves. `reads` counts the
    watch thread's reads: it reads the clock when it wakes up and again for its next wait, so three reads after a
    moment include one whole look at the section open then."""

    def __init__(self, fake: bool) -> None:
        self.fake, self.now, self.reads = fake, 0.0, Count()

    def perf_counter(self) -> float:
        if threading.current_thread().name == "stall-watch":
            self.reads.add()
        return self.now if self.fake else time.perf_counter()

    def looked(self) -> None:
        """Until the watch thread has looked at the loop's state as it is now."""
        self.reads.wait(self.reads.n + 3)


def clocked_watch(monkeypatch, fake: bool = True) -> tuple[StallWatch, Clock]:
    clock = Clock(fake)
    monkeypatch.setattr(stall_watch, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return StallWatch(threshold_s=0.05, period_s=0.01), clock


def counted_samples(monkeypatch, watch: StallWatch) -> Count:
    """The stack samples the watch takes (once per wake-up while a section runs long)."""
    samples, sample = Count(), watch._sample

    def counting(stall):
        sample(stall)
        samples.add()

    monkeypatch.setattr(watch, "_sample", counting)
    return samples


@pytest.fixture
def watched(monkeypatch):
    """A watch (threshold 50 ms, a look every 10 ms) on a clock the test moves."""
    w, clock = clocked_watch(monkeypatch)
    yield w, clock
    w.close()


def _stuck_in_a_slow_call(samples: Count, n: int) -> None:
    samples.wait(n)


def test_a_long_section_is_logged_with_the_call_it_was_stuck_in(watched, caplog, monkeypatch):
    watch, clock = watched
    samples = counted_samples(monkeypatch, watch)
    with caplog.at_level(logging.WARNING, logger="engines.process.stall"):
        with watch.section("engine step"):
            clock.now += 0.3
            _stuck_in_a_slow_call(samples, 3)  # until sampled repeatedly while stuck
    assert len(watch.stalls) == 1
    stall = watch.stalls[0]
    assert stall.section == "engine step" and stall.seconds == pytest.approx(0.3)
    loop_stacks = stall.samples["loop"]
    assert sum(loop_stacks.values()) >= 3
    assert "_stuck_in_a_slow_call" in loop_stacks.most_common(1)[0][0]
    assert "stall in engine step" in caplog.text and "_stuck_in_a_slow_call" in caplog.text


def test_other_threads_are_sampled_too(watched, monkeypatch):
    watch, clock = watched
    samples = counted_samples(monkeypatch, watch)
    stop = threading.Event()

    def codec_worker_like():
        while not stop.wait(0.01):
            pass

    t = threading.Thread(target=codec_worker_like, name="codec")
    t.start()
    try:
        with watch.section("message handling"):
            clock.now += 0.2
            samples.wait(1)
    finally:
        stop.set()
        t.join()
    assert "codec" in watch.stalls[-1].samples
    assert "codec_worker_like" in next(iter(watch.stalls[-1].samples["codec"]))


def test_short_sections_leave_no_record(watched, caplog):
    watch, clock = watched
    with caplog.at_level(logging.WARNING, logger="engines.process.stall"):
        for _ in range(20):
            with watch.section("engine step"):
                clock.now += 0.002
                clock.looked()  # the watch saw the section open, and short
    assert watch.stalls == [] and caplog.text == ""


def test_long_gc_pauses_are_recorded(monkeypatch):
    monkeypatch.setattr("engines.process.observe.stall_watch.GC_LOG_MS", 0.0)  # every collection counts as long
    watch = StallWatch()
    gc.disable()  # (only the collection below: no automatic one between the takes)
    try:
        watch.take_gc_pauses()
        gc.collect()
        assert len(watch.take_gc_pauses()) >= 1
        assert watch.take_gc_pauses() == []
    finally:
        gc.enable()
        watch.close()


def test_close_stops_the_thread_and_the_gc_hook():
    w = StallWatch()
    w.close()
    w._thread.join(WAIT_S)  # (close waits for it a second at most)
    assert not w._thread.is_alive()
    assert w._on_gc not in gc.callbacks


def test_wake_up_delays_sample_how_long_threads_wait_for_the_gil(monkeypatch):
    """The engine's load log reports these (GIL wait): a call holding the GIL delays the watch's next wake-up by
    about the call's length (the watch was due at most a period into it and cannot run before it returns)."""
    watch, clock = clocked_watch(monkeypatch, fake=False)
    try:
        clock.reads.wait(8)  # a few idle wake-ups
        idle = watch.take_wake_delays()
        assert len(idle) >= 3 and min(idle) >= 0.0
        c0 = time.thread_time()
        sum(range(40_000_000))  # one C call: the GIL is not released until it returns
        held_ms = 1e3 * (time.thread_time() - c0)  # (this thread's CPU time: at most the call's wall time)
        clock.looked()  # the watch woke up after the call
        delays = watch.take_wake_delays()
        assert held_ms > 5e3 * watch.period_s and max(delays) >= held_ms - 1e3 * watch.period_s - 1.0
    finally:
        watch.close()
    watch._thread.join(WAIT_S)
    watch.take_wake_delays()
    assert watch.take_wake_delays() == []  # a take clears them
