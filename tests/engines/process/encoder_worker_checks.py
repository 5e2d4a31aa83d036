"""Helpers of the encoder worker's tests, and its same-codes check that runs on the CPU
(tests/engines/process/test_encoder_worker.py) and on CUDA (tests/gpu/test_speech_encoder_gpu.py).
"""

from __future__ import annotations

import time

import numpy as np

from engines.process.encoder_worker import Encoded, EncoderWorker
from engines.speech_in import SpeechEncoder
from tests.engines.process.service_loop import WAIT_S
from tests.engines.speech_in.encoder_helpers import speech_like, whole_segment_codes


def wait_until_idle(worker: EncoderWorker) -> list[Encoded]:
    """Every result until the worker is idle (inline: running what is due; threaded: as its calls post them)."""
    out: list[Encoded] = []
    deadline = time.monotonic() + WAIT_S
    while True:
        if not worker.threaded:
            worker.run_due(flush=True)
        out += worker.take_results()
        with worker._cv:  # (notified whenever a call ends)
            if not worker.busy():
                return out
            if worker.threaded and not worker._results:
                assert worker._cv.wait(max(0.0, deadline - time.monotonic())), "the worker did not finish"


def codes_by_key(results: list[Encoded]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in results:
        assert not isinstance(e.codes, Exception), e.codes
        out.setdefault(e.key, []).extend(e.codes)
    return out


def assembled(results: list[Encoded]) -> dict[str, list[int]]:
    """Each turn's codes as the engine assembles them from these results, in order: each result's codes appended,
    then its re-encode (if any) applied to all of them."""
    out: dict[str, list[int]] = {}
    for e in results:
        assert not isinstance(e.codes, Exception), e.codes
        codes = out.setdefault(e.key, []) + e.codes
        out[e.key] = codes if e.refloor is None else e.refloor.apply(codes)
    return out


def check_committed_codes_are_the_whole_segment_ones_and_the_commit_comes_last(enc: SpeechEncoder, threaded: bool
                                                                              ) -> None:
    """Sessions' audio appended in 100 ms pieces and committed: each turn's codes, its re-encodes applied (made
    while it was spoken, or at its commit), are those of the whole-segment floor (whatever calls cut it into), its
    commit result comes last, and every stream's KV slot comes back."""
    pcms = {k: speech_like(sec, seed=i) for i, (k, sec) in enumerate([("a", 1.3), ("b", 0.7), ("c", 2.0)])}
    worker = EncoderWorker(enc, every_s=0.0, threaded=threaded)
    results: list[Encoded] = []
    for i in range(0, 32000, 1600):  # 100 ms pieces of every session
        for k, pcm in pcms.items():
            if i < pcm.size:
                worker.append(k, pcm[i:i + 1600])
        if not threaded:
            worker.run_due()
        results += worker.take_results()
    for k in pcms:
        assert worker.commit(k)
    results += wait_until_idle(worker)
    worker.close()
    assert assembled(results) == {k: whole_segment_codes(enc, p) for k, p in pcms.items()}
    for k in pcms:  # one commit result per turn, after its other codes
        mine = [e for e in results if e.key == k]
        assert [e.commit for e in mine].count(True) == 1 and mine[-1].commit
    assert not worker.commit("a")  # the turn ended with its commit
    assert enc.runner.kv.in_use == 0  # every stream closed, its slot back


class BrokenEncoder:
    """The tiny encoder, failing every call that includes a session whose audio is all at full scale."""

    def __init__(self, enc: SpeechEncoder) -> None:
        self.enc = enc

    def open_stream(self):
        return self.enc.open_stream()

    def batch(self, urgent=True):
        real = self.enc.batch(urgent)

        class Batch:
            def step(self, items):
                if any(np.all(pcm > 0.99) for _, pcm in items if len(pcm)):
                    raise RuntimeError("kernel failed")
                return real.step(items)

            def finalize(self, streams, last=None):
                if last is not None and any(np.all(p > 0.99) for p in last if len(p)):
                    raise RuntimeError("kernel failed")
                return real.finalize(streams, last)
        return Batch()
