"""The encoder worker's commit guard (`commit_guard_s`, `--encoder-commit-guard-ms`): a call of held audio does not
start while the server's VAD expects a commit (AppendUserAudio.commit_in_ms), so that the commit does not wait for
it; bounded past the commit's expected time and past the held call's own due time. Codes are unchanged."""

from __future__ import annotations

import math
import time

import pytest

from engines.codec.audio_io import float32_to_pcm16
from engines.service import messages as m
from engines.service.core import Service, ServiceError
from engines.service.encoder_worker import COMMIT_LATE_S, HELD_GUARD_MAX_S, EncoderWorker
from engines.service.tokenizer import StandInTokenizer
from tests.test_codec_encoder import speech_like
from tests.test_encoder_worker import _CallSpy, _codes_by_key, _engine, _wait, enc  # noqa: F401 (enc: fixture)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _worker(enc, guard_s: float = 0.05, every_s: float = 0.08):  # noqa: F811
    clock, spy = _Clock(), _CallSpy(enc)
    spy.worker = EncoderWorker(spy, every_s=every_s, clock=clock, commit_guard_s=guard_s)
    return spy.worker, spy, clock


def _speak(worker, pcms, start, end, quiet_key=None, commit_in_s=None):
    for k, pcm in pcms.items():
        quiet = k == quiet_key
        worker.append(k, pcm[start:end], quiet=quiet, commit_in_s=commit_in_s if quiet else None)


def test_a_held_call_waits_for_the_expected_commit_then_runs_after_it(enc):  # noqa: F811
    worker, spy, clock = _worker(enc)
    pcms = {k: speech_like(1.0, seed=100 + i) for i, k in enumerate("ab")}
    _speak(worker, pcms, 0, 4000)
    clock.now += 0.08  # held audio falls due
    _speak(worker, pcms, 4000, 5600, quiet_key="b", commit_in_s=0.03)  # b's VAD commits in 30 ms
    assert not worker.run_due()  # due, but b's commit is expected within the guard
    assert worker._held_start_at(2, clock.now) == pytest.approx(clock.now + 0.03 + COMMIT_LATE_S)
    clock.now += 0.02
    assert worker.commit("b") and worker.run_due()  # the commit comes (early): its call goes first
    assert worker.take_spans()["commit early"] == (1, pytest.approx(0.01), pytest.approx(0.01))  # (load log)
    assert spy.calls == [] and not worker.holding("b")  # (one stream: finalize, not a batched call)
    assert worker.run_due() and spy.calls == [("held", ["a"])]  # then the held call, at once
    count, waited, _ = worker.take_spans()["encode guard wait"]  # the load log's figure: 20 ms past its due time
    assert count == 1 and waited == pytest.approx(0.02)
    results = worker.take_results()
    assert worker.commit("a")
    results += _wait(worker)
    assert _codes_by_key(results) == {"a": enc.encode(pcms["a"][:5600]), "b": enc.encode(pcms["b"][:5600])}
    assert enc.runner.kv.in_use == 0


def test_a_commit_that_does_not_come_holds_the_call_only_so_long(enc):  # noqa: F811
    """Past the expected time by COMMIT_LATE_S the guard lets go (the user spoke again, or the VAD is late); and
    however many commits are expected, a held call waits at most HELD_GUARD_MAX_S past its due time."""
    worker, spy, clock = _worker(enc)
    pcms = {k: speech_like(1.0, seed=110 + i) for i, k in enumerate("abc")}
    _speak(worker, pcms, 0, 4000)
    due = clock.now + 0.08
    clock.now = due
    _speak(worker, pcms, 4000, 5600, quiet_key="b", commit_in_s=0.01)
    assert not worker.run_due()
    clock.now += 0.01 + COMMIT_LATE_S - 1e-6
    assert not worker.run_due()
    clock.now += 2e-6
    assert worker.run_due() and spy.calls[-1] == ("held", ["a", "b", "c"])
    # Expected commits one after another keep a call waiting no longer than HELD_GUARD_MAX_S past its due time.
    _speak(worker, pcms, 5600, 7200)
    due = clock.now + 0.08
    for i in range(12):
        clock.now = due + 0.03 * i  # (never on the bound itself)
        worker.append("c", pcms["c"][7200:7216], quiet=True, commit_in_s=0.03)
        ran = worker.run_due()
        assert ran == (clock.now >= due + HELD_GUARD_MAX_S), (i, ran)
        if ran:
            break
    assert ran and spy.calls[-1] == ("held", ["a", "b", "c"])
    worker.close()


def test_expected_commits_outside_the_guard_and_flushes_do_not_hold_a_call(enc):  # noqa: F811
    worker, spy, clock = _worker(enc, guard_s=0.05)
    pcms = {k: speech_like(1.0, seed=120 + i) for i, k in enumerate("ab")}
    _speak(worker, pcms, 0, 4000, quiet_key="b", commit_in_s=0.08 + 0.06)  # expected 60 ms after the call's due time
    clock.now += 0.08
    assert worker.run_due() and spy.calls == [("held", ["a", "b"])]
    worker.append("a", pcms["a"][4000:5600])
    clock.now += 0.08  # due
    worker.append("b", pcms["b"][4000:5600], quiet=True, commit_in_s=0.01)
    assert not worker.run_due() and worker.run_due(flush=True)  # a flush runs it whatever is expected
    # Speech again (no commit_in) takes the expectation back.
    worker.append("a", pcms["a"][5600:7200])
    clock.now += 0.08
    worker.append("b", pcms["b"][5600:7200], quiet=True, commit_in_s=0.01)
    assert not worker.run_due()
    worker.append("b", pcms["b"][7200:7300])
    assert worker._turns["b"].commit_at is None and worker.run_due()
    worker.close()


def test_without_the_guard_nothing_waits(enc):  # noqa: F811
    worker, spy, clock = _worker(enc, guard_s=0.0)
    pcms = {"a": speech_like(0.5, seed=130)}
    worker.append("a", pcms["a"][:4000], quiet=True, commit_in_s=0.0)
    clock.now += 0.08
    assert worker._held_start_at(1, clock.now) == pytest.approx(clock.now)
    assert worker.run_due() and "encode guard wait" not in worker.take_spans()
    worker.close()


@pytest.mark.parametrize("guard", [-0.01, 1.5, math.nan])
def test_a_guard_out_of_range_is_refused(enc, guard):  # noqa: F811
    with pytest.raises(ValueError, match="commit_guard_s must be in"):
        EncoderWorker(enc, commit_guard_s=guard)


def test_on_its_thread_a_guarded_call_runs_once_the_guard_ends(enc):  # noqa: F811
    """The worker's thread sleeps until the guard ends (no commit comes), then runs the held call by itself."""
    worker = EncoderWorker(enc, every_s=0.0, threaded=True, commit_guard_s=0.05)
    pcm = speech_like(0.5, seed=140)
    worker.append("a", pcm[:4000], quiet=True, commit_in_s=0.02)
    deadline = time.monotonic() + 10
    while worker.holding("a") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not worker.holding("a")
    assert worker.commit("a")
    results = _wait(worker)
    worker.close()
    assert _codes_by_key(results) == {"a": enc.encode(pcm[:4000])}


def test_commit_in_ms_reaches_the_worker_and_bad_values_are_refused(enc):  # noqa: F811
    svc = Service(_engine(), StandInTokenizer(), enc, None, encoder_commit_guard_s=0.04)
    assert svc._speech.commit_guard_s == 0.04
    svc.handle(b"c", m.OpenSession("a"))
    pcm = float32_to_pcm16(speech_like(0.2, seed=150))
    before = time.monotonic()
    svc.handle(b"c", m.decode(m.encode(m.AppendUserAudio("a", pcm, quiet=True, commit_in_ms=250.0))))
    at = svc._speech._turns["a"].commit_at
    assert at is not None and before + 0.25 <= at <= time.monotonic() + 0.25
    for bad in (-1.0, 60_001, float("nan"), True, "soon"):
        with pytest.raises(ServiceError, match="commit_in_ms must be"):
            svc._on_AppendUserAudio(b"c", m.AppendUserAudio("a", pcm, quiet=True, commit_in_ms=bad))
    assert Service(_engine(), StandInTokenizer(), enc, None)._speech.commit_guard_s == 0.0  # off by default
    svc.handle(b"c", m.CloseSession("a"))
