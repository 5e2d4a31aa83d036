"""The engine process's Service as its options build it (loading.py): each option reaches the part it sets."""

from __future__ import annotations

import pytest
import torch

from engines.config import EngineConfig
from engines.process.codec_pacing import BULK_MAX, PLAYING_SOLVE_PARTS
from engines.process.config import ProcessConfig
from engines.process.loading import _load_codec, build_service
from engines.process.observe.startup_memory import StartupMemory
from engines.speech_in import SpeechEncoder

# The engine's options for a CPU service of the tiny model, with its codec or none, no warm-up turns.
TINY = ["--device", "cpu", "--model", "tiny-random", "--codec", "tiny-random", "--no-warm-up"]
NO_CODEC = ["--device", "cpu", "--model", "tiny-random", "--codec", "none", "--no-warm-up"]


def _service(argv: list[str]):
    return build_service(ProcessConfig.parse(argv))


def test_device_auto_resolves_to_an_available_device():
    """`--device auto` picks the GPU when there is one, else the CPU (the server's default setting)."""
    svc = _service(["--device", "auto", "--codec", "none"])
    assert svc.engine.config.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_first_lane_is_off_on_the_cpu_by_default_and_wired_when_asked():
    """--first-lane (default: on a GPU): lanes of the decoder for first chunks (--first-lanes, 2 by default), one graph
    per solve, and the playing decoder's full-chunk solves in PLAYING_SOLVE_PARTS pieces, so its rounds can pause
    between them."""
    base = TINY
    plain = _service(base)
    assert plain._codec.first_decoder is None and plain.decoder.flow.solve_parts == 1
    laned = _service(base + ["--first-lane", "--first-lanes", "1"])
    lane = laned._codec.first_decoder
    assert lane is not None and lane is not laned.decoder
    assert laned.decoder.flow.solve_parts == PLAYING_SOLVE_PARTS and lane.flow.solve_parts == 1
    assert [t.name for t in laned._codec._threads] == ["codec-worker-first", "codec-worker-playing"]
    two = _service(base + ["--first-lane"])  # two lanes by default
    assert len(two._codec.first_decoders) == 2 and two._codec.first_decoders[0] is not two._codec.first_decoders[1]
    assert all(d.flow.solve_parts == 1 for d in two._codec.first_decoders)
    assert [t.name for t in two._codec._threads] == ["codec-worker-first", "codec-worker-first-2",
                                                     "codec-worker-playing"]
    for svc in (plain, laned, two):
        svc._codec.close()


def test_codec_round_options_reach_the_worker():
    base = TINY
    for extra, want in (([], BULK_MAX), (["--codec-round-max", "24"], 24)):
        svc = _service(base + extra)
        assert svc._codec.bulk_max == want
        svc._codec.close()
    # The period applies to rounds of playing answers, which exist beside a first lane only.
    for extra, want in (([], 0.0), (["--first-lane"], 0.2), (["--first-lane", "--codec-round-period-ms", "0"], 0.0),
                        (["--first-lane", "--codec-round-period-ms", "250"], 0.25),
                        (["--codec-round-period-ms", "250"], 0.0)):
        svc = _service(base + extra)
        assert svc._codec.period_s == want
        svc._codec.close()
    svc = _service(base + ["--first-lane", "--codec-round-max", "24", "--codec-round-period-ms", "0"])
    assert svc._codec.bulk_max == 24 and svc._codec.period_s == 0.0
    svc._codec.close()


def test_the_decoder_cache_dtype_reaches_the_codec_decoder():
    for extra, want in (([], torch.float32), (["--decoder-cache-dtype", "fp8"], torch.float8_e4m3fn)):
        svc = _service(TINY + extra)
        assert svc.decoder.full.pages.pool.dtype == want  # (on the CPU the estimator is float32)
        svc._codec.close()


def test_ramp_step_rows_reach_the_engine():
    for extra, want in (([], EngineConfig.ramp_step_rows), (["--ramp-step-rows", "0"], 0),
                        (["--ramp-step-rows", "96"], 96)):
        assert _service(NO_CODEC + extra).engine.config.ramp_step_rows == want


def test_step_rows_reach_the_engine():
    for extra, want in (([], EngineConfig.prefill_token_budget), (["--max-running", "300"], 600),
                        (["--step-rows", "200"], 200), (["--max-running", "64", "--step-rows", "96"], 96)):
        assert _service(NO_CODEC + extra).engine.config.prefill_token_budget == want


def test_encoder_tf32_reaches_the_speech_encoder(monkeypatch):
    """--encoder-tf32's value is what the speech encoder is loaded with (the load is stopped there: the rest of the
    codec is not this test's; on a CPU a config for a CUDA device is enough to get that far)."""
    class Loaded(Exception):
        pass

    seen = []

    def load(cls, path, **kw):
        seen.append(kw)
        raise Loaded

    monkeypatch.setattr(SpeechEncoder, "load", classmethod(load))
    base = ["--device", "cuda", "--model", "tiny-random", "--codec", "tiny-random", "--no-warm-up"]
    for flag in ([], ["--encoder-tf32"]):
        config = ProcessConfig.parse(base + flag)
        with pytest.raises(Loaded):
            _load_codec(config, config.engine_config(), StartupMemory("cpu"))
    assert [kw["tf32"] for kw in seen] == [False, True]


def test_a_tf32_speech_encoder_needs_float32_on_cuda():
    with pytest.raises(ValueError, match="TF32 needs float32 on a CUDA device, got torch.float32 on cpu"):
        SpeechEncoder.load("tiny-random", device="cpu", tf32=True)
    assert SpeechEncoder.load("tiny-random", device="cpu").runner.tf32 is False
