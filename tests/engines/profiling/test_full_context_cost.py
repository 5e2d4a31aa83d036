"""full_context_cost's phase timing (`--phases`): each phase of a round timed, with timing events the round around
its phases too, and the decoder left as it was; and its counts checked as they are parsed."""

from __future__ import annotations

import time

import pytest
import torch

from engines.profiling import full_context_cost
from engines.profiling.codec_timeline import Timeline
from engines.profiling.full_context_cost import PHASES, _phases, _rounds_ahead
from engines.speech_out import CodecDecoder, Voice


def test_phases_time_every_phase_of_the_rounds_and_leave_the_decoder_unwrapped():
    dec = CodecDecoder.load("tiny-random", device="cpu", vocoder="hift", context="full", cache_gib=0.05)
    got = _phases(dec, 2, 6, Voice.random(seed=3, n_codes=12), last=1)  # one round: its parts sum within it
    # (no GPU timeline on a CPU)
    assert set(got) == {"round", "host_wait", "host_encoder", "host_solve", "host_vocoder"}
    assert all(v > 0 for k, v in got.items() if k != "host_wait")
    assert got["host_encoder"] + got["host_solve"] + got["host_vocoder"] <= got["round"]
    for owner, method, _ in PHASES:
        assert method not in vars(getattr(dec, owner))  # the class's own method again


class _Event:
    """A CUDA timing event's stand-in on the host clock."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


def test_phases_on_a_device_with_timing_events_also_time_the_round_around_its_phases(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    timeline_init = Timeline.__init__
    monkeypatch.setattr(Timeline, "__init__", lambda self, cuda: timeline_init(self, True))
    dec = CodecDecoder.load("tiny-random", device="cpu", vocoder="hift", context="full", cache_gib=0.05)
    got = _phases(dec, 2, 6, Voice.random(seed=3, n_codes=12), last=1)  # one round: its parts sum within it
    assert {"gpu_encoder", "gpu_solve", "gpu_vocoder", "gpu_before_phases", "gpu_after_phases"} <= set(got)
    assert 0 <= got["gpu_before_phases"] and 0 <= got["gpu_after_phases"]
    assert got["gpu_before_phases"] + got["gpu_encoder"] + got["gpu_solve"] + got["gpu_vocoder"] <= got["round"]


def test_rounds_queued_ahead_are_timed_from_one_rounds_pcm_to_the_next():
    dec = CodecDecoder.load("tiny-random", device="cpu", vocoder="hift", context="full", cache_gib=0.05)
    ms = _rounds_ahead(dec, 2, 4, Voice.random(seed=3, n_codes=12))
    assert len(ms) == 4 and all(t > 0 for t in ms)


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--batches", "8", "x"], ["--prompt-codes", "-1"]])
def test_a_bad_count_is_a_usage_error_as_in_bench_codec(argv, capsys):
    with pytest.raises(SystemExit) as e:
        full_context_cost.main(argv)
    assert e.value.code == 2 and "error: argument" in capsys.readouterr().err
