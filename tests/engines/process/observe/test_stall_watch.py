"""The engine loop's stall watch names the call a long section was stuck in, and leaves short sections alone."""

import gc
import logging
import threading
import time

import pytest

from engines.process.observe.stall_watch import StallWatch


@pytest.fixture
def watch():
    w = StallWatch(threshold_s=0.05, period_s=0.01)
    yield w
    w.close()


def _stuck_in_a_slow_call(seconds: float) -> None:
    time.sleep(seconds)


def test_a_long_section_is_logged_with_the_call_it_was_stuck_in(watch, caplog):
    with caplog.at_level(logging.WARNING, logger="engines.process.stall"):
        with watch.section("engine step"):
            _stuck_in_a_slow_call(0.3)
    assert len(watch.stalls) == 1
    stall = watch.stalls[0]
    assert stall.section == "engine step" and stall.seconds >= 0.3
    loop_stacks = stall.samples["loop"]
    assert sum(loop_stacks.values()) >= 3  # sampled repeatedly while stuck
    assert "_stuck_in_a_slow_call" in loop_stacks.most_common(1)[0][0]
    assert "stall in engine step" in caplog.text and "_stuck_in_a_slow_call" in caplog.text


def test_other_threads_are_sampled_too(watch):
    stop = threading.Event()

    def codec_worker_like():
        while not stop.is_set():
            _stuck_in_a_slow_call(0.01)

    t = threading.Thread(target=codec_worker_like, name="codec")
    t.start()
    try:
        with watch.section("message handling"):
            time.sleep(0.2)
    finally:
        stop.set()
        t.join()
    assert "codec" in watch.stalls[-1].samples
    assert "codec_worker_like" in next(iter(watch.stalls[-1].samples["codec"]))


def test_short_sections_leave_no_record(watch, caplog):
    with caplog.at_level(logging.WARNING, logger="engines.process.stall"):
        for _ in range(20):
            with watch.section("engine step"):
                time.sleep(0.002)
    assert watch.stalls == [] and caplog.text == ""


def test_long_gc_pauses_are_recorded(monkeypatch, watch):
    monkeypatch.setattr("engines.process.observe.stall_watch.GC_LOG_MS", 0.0)  # every collection counts as long
    watch.take_gc_pauses()
    gc.collect()
    assert len(watch.take_gc_pauses()) >= 1
    assert watch.take_gc_pauses() == []


def test_close_stops_the_thread_and_the_gc_hook():
    w = StallWatch()
    w.close()
    assert not w._thread.is_alive()
    assert w._on_gc not in gc.callbacks


def test_wake_up_delays_sample_how_long_threads_wait_for_the_gil(watch):
    """The engine's load log reports these (GIL wait): a call holding the GIL delays the watch's next wake-up."""
    time.sleep(0.1)
    idle = watch.take_wake_delays()
    assert len(idle) >= 3 and min(idle) >= 0.0
    assert len(watch.take_wake_delays()) <= 2  # a take clears them (a wake-up or two may land between)
    t0 = time.perf_counter()
    sum(range(40_000_000))  # one C call: the GIL is not released until it returns
    held_ms = 1e3 * (time.perf_counter() - t0)
    time.sleep(0.05)
    delays = watch.take_wake_delays()
    assert held_ms > 50 and max(delays) > 0.5 * held_ms - 20
