"""The speech encoder worker's faults (engines/process/encoder_worker.py): a commit without audio or of an unknown
turn, a dropped turn leaving nothing behind, errors inside and outside the encoder's calls failing only the turns
they touch, a stream that fails to close; the thread lives on through each."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engines.process.encoder_worker import EncoderWorker
from tests.engines.process.encoder_worker_checks import BrokenEncoder, assembled, codes_by_key, wait_until_idle
from tests.engines.process.service_loop import WAIT_S
from tests.engines.speech_in.encoder_helpers import speech_like, whole_segment_codes


def test_commit_of_a_turn_without_audio_and_an_unknown_one(enc):
    worker = EncoderWorker(enc)
    assert not worker.commit("nobody")
    worker.append("a", np.zeros(0, np.float32))  # an empty append opens a turn with no audio
    assert worker.commit("a")
    (e,) = wait_until_idle(worker)
    assert (e.key, e.codes, e.commit) == ("a", [], True) and 0 < e.started <= e.at


@pytest.mark.parametrize("threaded", [False, True])
def test_a_dropped_turn_gives_no_more_results_and_frees_its_stream(enc, threaded):
    gate, calling = threading.Event(), threading.Event()

    class SlowEncoder:  # holds its call until the test drops the turn
        def open_stream(self):
            return enc.open_stream()

        def batch(self, urgent=True):
            calling.set()
            assert gate.wait(WAIT_S), "the test never opened the gate"
            return enc.batch(urgent)

    worker = EncoderWorker(SlowEncoder(), threaded=threaded)
    worker.append("a", speech_like(0.5, seed=1))
    worker.append("b", speech_like(0.5, seed=2))
    if threaded:
        assert calling.wait(WAIT_S) and worker._running  # the call is in flight ...
        worker.drop("a")  # ... when a's turn is dropped
        gate.set()
    else:
        gate.set()
        worker.run_due(flush=True)
        worker.drop("a")  # results produced but not yet taken go too
    results = wait_until_idle(worker)
    worker.close()
    alone = enc.open_stream()
    assert [e.key for e in results] == ["b"] and results[0].codes == alone.push(speech_like(0.5, seed=2))
    alone.close()
    worker.drop("b")
    assert not worker.busy() and enc.runner.kv.in_use == 0


def test_the_thread_survives_an_error_outside_the_encoders_calls(enc, monkeypatch):
    """An error the worker did not expect (here, in taking the due work) fails every turn it holds, a committing one
    as its commit's result, instead of killing the thread and leaving those sessions waiting; later turns encode."""
    worker = EncoderWorker(enc, every_s=60.0, threaded=True)  # held audio is not due: only the commit runs
    take = worker._take_due
    broken = [True]

    def take_due(now, flush):
        if broken[0] and any(t.commit for t in worker._turns.values()):
            broken[0] = False
            raise MemoryError("no room for the audio")
        return take(now, flush)

    monkeypatch.setattr(worker, "_take_due", take_due)
    worker.append("a", speech_like(0.4, seed=1))
    worker.append("b", speech_like(0.4, seed=2))
    assert worker.commit("a")
    results = wait_until_idle(worker)
    assert sorted((e.key, e.commit, type(e.codes).__name__) for e in results) == [
        ("a", True, "MemoryError"), ("b", False, "MemoryError")]
    assert worker._turns == {} and enc.runner.kv.in_use == 0  # their streams closed
    worker.append("c", speech_like(0.4, seed=3))  # the thread lives on
    assert worker.commit("c")
    after = wait_until_idle(worker)
    worker.close()
    assert assembled(after) == {"c": whole_segment_codes(enc, speech_like(0.4, seed=3))}


def test_every_committing_turn_fails_when_gathering_their_audio_fails(enc):
    """Commits are taken out of the worker's turns before their audio is gathered: a failure there still fails every
    one of them (none is left waiting for its commit's codes)."""
    worker = EncoderWorker(enc, every_s=60.0, threaded=True)
    for key in "ab":
        worker.append(key, speech_like(0.2, seed=5))
        worker.append(key, speech_like(0.2, seed=6)[None, :])  # a piece that cannot be joined to the first
    for key in "ab":
        assert worker.commit(key)
    results = wait_until_idle(worker)
    worker.close()
    assert sorted((e.key, e.commit, type(e.codes).__name__) for e in results) == [
        ("a", True, "ValueError"), ("b", True, "ValueError")]


def test_a_stream_that_fails_to_close_does_not_stop_the_worker(enc):
    class Stream:
        def __init__(self) -> None:
            self.inner = enc.open_stream()

        def push(self, pcm):
            return self.inner.push(pcm)

        def finalize(self, last=None):
            return self.inner.finalize(last)

        def close(self) -> None:
            self.inner.close()
            raise RuntimeError("close failed")

    class Encoder:
        def open_stream(self):
            return Stream()

    worker = EncoderWorker(Encoder(), threaded=True)
    for key in "ab":
        worker.append(key, speech_like(0.4, seed=4))
        assert worker.commit(key)
        results = wait_until_idle(worker)
        assert [(e.key, e.commit) for e in results][-1] == (key, True)
        assert not any(isinstance(e.codes, Exception) for e in results)
    worker.close()


def test_a_failed_call_fails_its_turns_only(enc):
    worker = EncoderWorker(BrokenEncoder(enc))
    worker.append("a", np.ones(3200, np.float32))
    worker.append("b", speech_like(0.4, seed=3))
    results = wait_until_idle(worker)
    assert sorted(e.key for e in results) == ["a", "b"]
    assert all(isinstance(e.codes, RuntimeError) and not e.commit for e in results)
    assert enc.runner.kv.in_use == 0 and not worker.commit("a")  # both turns are over
    worker.append("b", speech_like(0.4, seed=3))  # the session's next turn encodes as usual
    assert worker.commit("b")
    assert codes_by_key(wait_until_idle(worker)) == {"b": enc.encode(speech_like(0.4, seed=3))}
