"""full_context_cost's phase timing (`--phases`): each phase of a round timed, and the decoder left as it was."""

from __future__ import annotations

from engines.profiling.full_context_cost import PHASES, _phases
from engines.speech_out import CodecDecoder, Voice


def test_phases_time_every_phase_of_the_rounds_and_leave_the_decoder_unwrapped():
    dec = CodecDecoder.load("tiny-random", device="cpu", vocoder="hift", context="full", cache_gib=0.05)
    got = _phases(dec, 2, 6, Voice.random(seed=3, n_codes=12), last=3)
    # (no GPU timeline on a CPU)
    assert set(got) == {"round", "host_wait", "host_encoder", "host_solve", "host_vocoder"}
    assert all(v > 0 for k, v in got.items() if k != "host_wait")
    assert got["host_encoder"] + got["host_solve"] + got["host_vocoder"] <= got["round"]
    for owner, method, _ in PHASES:
        assert method not in vars(getattr(dec, owner))  # the class's own method again
