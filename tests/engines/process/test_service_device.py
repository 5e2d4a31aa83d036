"""`--device auto` picks the GPU when there is one, else the CPU (the server's default setting)."""

from __future__ import annotations

import argparse

import pytest
import torch

from engines.process.main import add_arguments, build_service

# The engine's options for a CPU service of the tiny model, with its codec or none, no warm-up turns.
TINY = ["--device", "cpu", "--model", "tiny-random", "--codec", "tiny-random", "--no-warm-up"]
NO_CODEC = ["--device", "cpu", "--model", "tiny-random", "--codec", "none", "--no-warm-up"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_device_auto_resolves_to_an_available_device():
    p = _parser()
    args = p.parse_args(["--device", "auto", "--codec", "none"])
    svc = build_service(args)
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert svc.engine.config.device == want
    assert args.device == want


def test_first_lane_is_off_on_the_cpu_by_default_and_wired_when_asked():
    """--first-lane (default: on a GPU): lanes of the decoder for first chunks (--first-lanes, 2 by default), one graph
    per solve, and the playing decoder's full-chunk solves in PLAYING_SOLVE_PARTS pieces, so its rounds can pause
    between them."""
    from engines.process.codec_pacing import PLAYING_SOLVE_PARTS

    p, base = _parser(), TINY
    plain = build_service(p.parse_args(base))
    assert plain._codec.first_decoder is None and plain.decoder.flow.solve_parts == 1
    laned = build_service(p.parse_args(base + ["--first-lane", "--first-lanes", "1"]))
    lane = laned._codec.first_decoder
    assert lane is not None and lane is not laned.decoder
    assert laned.decoder.flow.solve_parts == PLAYING_SOLVE_PARTS and lane.flow.solve_parts == 1
    assert [t.name for t in laned._codec._threads] == ["codec-worker-first", "codec-worker-playing"]
    two = build_service(p.parse_args(base + ["--first-lane"]))  # two lanes by default
    assert len(two._codec.first_decoders) == 2 and two._codec.first_decoders[0] is not two._codec.first_decoders[1]
    assert all(d.flow.solve_parts == 1 for d in two._codec.first_decoders)
    assert [t.name for t in two._codec._threads] == ["codec-worker-first", "codec-worker-first-2",
                                                     "codec-worker-playing"]
    for svc in (plain, laned, two):
        svc._codec.close()


def test_codec_round_options_reach_the_worker_and_bad_values_are_refused(capsys):
    from engines.process.codec_pacing import BULK_MAX

    p, base = _parser(), TINY
    for extra, want in (([], BULK_MAX), (["--codec-round-max", "24"], 24)):
        svc = build_service(p.parse_args(base + extra))
        assert svc._codec.bulk_max == want
        svc._codec.close()
    # The period applies to rounds of playing answers, which exist beside a first lane only.
    for extra, want in (([], 0.0), (["--first-lane"], 0.2), (["--first-lane", "--codec-round-period-ms", "0"], 0.0),
                        (["--first-lane", "--codec-round-period-ms", "250"], 0.25),
                        (["--codec-round-period-ms", "250"], 0.0)):
        svc = build_service(p.parse_args(base + extra))
        assert svc._codec.period_s == want
        svc._codec.close()
    # A round size means nothing to rounds started once a period (they take every answer due): refused, not ignored.
    with pytest.raises(ValueError, match="--codec-round-period-ms 0"):
        build_service(p.parse_args(base + ["--first-lane", "--codec-round-max", "24"]))
    svc = build_service(p.parse_args(base + ["--first-lane", "--codec-round-max", "24",
                                             "--codec-round-period-ms", "0"]))
    assert svc._codec.bulk_max == 24 and svc._codec.period_s == 0.0
    svc._codec.close()
    for opt, bad in (("--codec-round-max", "0"), ("--codec-round-max", "-3"), ("--codec-round-max", "many"),
                     ("--codec-round-period-ms", "-5"), ("--codec-round-period-ms", "nan"),
                     ("--codec-round-period-ms", "inf"), ("--codec-round-period-ms", "soon"),
                     ("--encode-every-ms", "-80"), ("--encode-every-ms", "nan")):
        with pytest.raises(SystemExit):
            p.parse_args(base + [opt, bad])
        assert opt in capsys.readouterr().err


def test_ramp_step_rows_reaches_the_engine_and_bad_values_are_refused(capsys):
    from engines.config import EngineConfig

    p, base = _parser(), NO_CODEC
    for extra, want in (([], EngineConfig.ramp_step_rows), (["--ramp-step-rows", "0"], 0),
                        (["--ramp-step-rows", "96"], 96)):
        svc = build_service(p.parse_args(base + extra))
        assert svc.engine.config.ramp_step_rows == want
    for bad in ("-1", "few"):
        with pytest.raises(SystemExit):
            p.parse_args(base + ["--ramp-step-rows", bad])
        assert "--ramp-step-rows" in capsys.readouterr().err


def test_step_rows_reach_the_engine_and_must_exceed_max_running(capsys):
    from engines.config import ConfigError, EngineConfig

    p, base = _parser(), NO_CODEC
    for extra, want in (([], EngineConfig.prefill_token_budget), (["--max-running", "300"], 600),
                        (["--step-rows", "200"], 200), (["--max-running", "64", "--step-rows", "96"], 96)):
        assert build_service(p.parse_args(base + extra)).engine.config.prefill_token_budget == want
    with pytest.raises(ConfigError, match=r"--step-rows 64 must exceed .*--max-running 64"):
        build_service(p.parse_args(base + ["--max-running", "64", "--step-rows", "64"]))
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--step-rows", "0"])
    assert "--step-rows" in capsys.readouterr().err


def test_load_log_names_the_codec_solves_and_their_padding():
    """The load log's codec solves: per kind of round, the decoders' counts since the last log (then reset)."""
    from engines.process.main import _solves
    from engines.speech_out.decoder import SolveCounts

    class Dec:
        def __init__(self, *counts):
            self.counts = SolveCounts(*counts)

        def take_counts(self):
            c, self.counts = self.counts, SolveCounts()
            return c

    lanes = [Dec(3, 0, 4, 4), Dec(1, 1, 2, 2)]
    assert _solves("first-chunk", lanes) == "; first-chunk solves 4 (1 partial) of 1.5 sessions as 1.5 rows"
    assert _solves("first-chunk", lanes) == ""  # taken
    assert _solves("playing", [Dec(2, 0, 66, 80)]) == "; playing solves 2 (0 partial) of 33.0 sessions as 40.0 rows"
    assert _solves("playing", [object()]) == ""  # a decoder without counts (a test's fake)


def test_encoder_tf32_needs_a_gpu_and_reaches_the_speech_encoder(monkeypatch):
    """--encoder-tf32: refused off a GPU with the option named; its value is what the speech encoder is loaded
    with (the load is stopped there: the rest of the codec is not this test's)."""
    from engines.process import main as process
    from engines.process.observe.startup_memory import StartupMemory
    from engines.speech_in import SpeechEncoder

    p, base = _parser(), TINY
    assert p.parse_args(base).encoder_tf32 is False  # float32 accuracy unless asked
    with pytest.raises(ValueError, match="--encoder-tf32 needs a CUDA device"):
        build_service(p.parse_args(base + ["--encoder-tf32"]))

    class Loaded(Exception):
        pass

    seen = []

    def load(cls, path, **kw):
        seen.append(kw)
        raise Loaded

    monkeypatch.setattr(SpeechEncoder, "load", classmethod(load))
    for flag in ([], ["--encoder-tf32"]):
        with pytest.raises(Loaded):
            process._load_codec(p.parse_args(base + flag), None, StartupMemory("cpu"))
    assert [kw["tf32"] for kw in seen] == [False, True]


def test_a_tf32_speech_encoder_needs_float32_on_cuda():
    from engines.speech_in import SpeechEncoder

    with pytest.raises(ValueError, match="TF32 needs float32 on a CUDA device, got torch.float32 on cpu"):
        SpeechEncoder.load("tiny-random", device="cpu", tf32=True)
    assert SpeechEncoder.load("tiny-random", device="cpu").runner.tf32 is False
