"""The speech encoder worker on its thread under a random mix of sessions speaking, committing early (tentatively),
committing and clearing their audio: held calls, rewinds and commits interleave as they come, and still every
committed turn's codes, as the engine assembles them (re-encodes applied), are those of its whole audio with the
whole-segment floor, no result fails, and every stream's KV slot comes back."""

from __future__ import annotations

import numpy as np

from engines.process.encoder_worker import Encoded, EncoderWorker
from tests.engines.process.encoder_worker_checks import wait_until_idle
from tests.engines.speech_in.encoder_helpers import speech_en, whole_segment_codes

KEYS = "abcd"


class Turns:
    """What the engine would hold of each session's turn, from the worker's results as they come."""

    def __init__(self, enc) -> None:
        self.enc = enc
        self.codes = {k: [] for k in KEYS}
        self.audio: dict[str, list[np.ndarray]] = {k: [] for k in KEYS}
        self.commits: dict[str, list[bool]] = {k: [] for k in KEYS}  # the commits asked, final or not, in order
        self.checked = 0

    def take(self, results: list[Encoded]) -> None:
        for e in results:
            assert not isinstance(e.codes, Exception), e.codes
            codes = self.codes[e.key] + e.codes
            self.codes[e.key] = codes if e.refloor is None else e.refloor.apply(codes)
            if e.commit and self.commits[e.key].pop(0):  # the turn's last result
                pcm = np.concatenate(self.audio[e.key])
                assert self.codes[e.key] == whole_segment_codes(self.enc, pcm), e.key
                self.checked += 1
                self.codes[e.key], self.audio[e.key] = [], []

    def drop(self, key: str) -> None:
        self.codes[key], self.audio[key] = [], []


def test_random_turns_on_the_threaded_worker_commit_with_their_whole_segment_codes(enc):
    rng = np.random.default_rng(11)
    source = speech_en(4.0)  # a quiet start, then speech whose max rises now and then
    worker = EncoderWorker(enc, every_s=0.0, threaded=True)
    turns = Turns(enc)
    cursor = dict.fromkeys(KEYS, 0)
    for _ in range(160):
        key = KEYS[rng.integers(len(KEYS))]
        action = rng.random()
        if action < 0.75 or not turns.audio[key]:
            if not turns.audio[key]:
                cursor[key] = int(rng.integers(0, 4000))  # each turn starts in the quiet part
            n = int(rng.integers(320, 4800))
            piece = source[cursor[key]:cursor[key] + n]
            cursor[key] = (cursor[key] + n) % (source.size - 4800)
            worker.append(key, piece)
            turns.audio[key].append(piece)
        elif action < 0.97:
            final = action >= 0.83
            turns.commits[key].append(final)
            assert worker.commit(key, final=final)
            # (the service sends a session nothing more until its commit's result is in)
            turns.take(wait_until_idle(worker))
        else:
            worker.drop(key)
            turns.drop(key)
            turns.commits[key] = []
        turns.take(worker.take_results())
    for key in KEYS:
        if turns.audio[key]:
            turns.commits[key].append(True)
            assert worker.commit(key)
    turns.take(wait_until_idle(worker))
    worker.close()
    calls = worker.take_spans()
    assert calls["encode rewind"][0] >= 3 and calls["encode"][0] >= 10  # (count, seconds, max): they interleaved
    assert turns.checked >= 10 and not any(turns.commits.values())
    assert enc.runner.kv.in_use == 0
