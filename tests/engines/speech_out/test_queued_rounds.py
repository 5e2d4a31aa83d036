"""Rounds queued ahead (CodecDecoder.queue_jobs, engines/speech_out/queued.py): a round queued before the one before it
is collected gives the PCM that rounds run one after another give, each answer's held tail included, for both
decoder contexts (tiny codec on the CPU, where a queued round has already run: what this checks is the host's
bookkeeping at collect time, which carries an answer's crossfade from round to round)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.speech_out import CodecDecoder
from engines.speech_out.stream import Job

CODES = (23, 17, 9)  # answers of unequal length: rounds of 3, then 2, then 1 answer


def _round_jobs(dec: CodecDecoder) -> tuple[list, list[list[Job]]]:
    """Streams with all their codes, and the rounds decoding them: round r holds each answer's r-th chunk, and an
    answer's last round releases its held tail (a job of no codes) in the round right after its last chunk."""
    rng = np.random.default_rng(0)
    streams = [dec.open_stream(f"s{i}", seed=i) for i in range(len(CODES))]
    per_stream = []
    for s, n in zip(streams, CODES, strict=True):
        s.add(rng.integers(0, 16384, n))
        per_stream.append(s.take_jobs() + [Job(s, [], [], True)])
    rounds = [[js[r] for js in per_stream if r < len(js)] for r in range(max(map(len, per_stream)))]
    return streams, rounds


def _pcm(dec: CodecDecoder, ahead: bool) -> list[np.ndarray]:
    streams, rounds = _round_jobs(dec)
    out: dict[int, list[np.ndarray]] = {id(s): [] for s in streams}

    def take(jobs: list[Job], pcm: list) -> None:
        for j, p in zip(jobs, pcm, strict=True):
            out[id(j.stream)].append(p)

    if ahead:
        queued = [(jobs, dec.queue_jobs(jobs)) for jobs in rounds[:1]]
        for jobs in rounds[1:]:
            queued.append((jobs, dec.queue_jobs(jobs)))  # before the round before it is collected
            done_jobs, q = queued.pop(0)
            take(done_jobs, q.collect())
        for done_jobs, q in queued:
            take(done_jobs, q.collect())
    else:
        for jobs in rounds:
            take(jobs, dec.run_jobs(jobs))
    pcm = [np.concatenate(out[id(s)]) for s in streams]
    for s in streams:
        s.close()
    return pcm


@pytest.mark.parametrize("context", ["full", "window"])
def test_rounds_queued_ahead_give_the_pcm_of_rounds_one_after_another(context):
    dec = CodecDecoder.load("tiny-random", device="cpu", vocoder="hift", context=context,
                            cache_gib=0.05 if context == "full" else None)
    ahead, serial = _pcm(dec, True), _pcm(dec, False)
    for a, s in zip(ahead, serial, strict=True):
        assert a.shape == s.shape and a.size > 0
        np.testing.assert_array_equal(a, s)
