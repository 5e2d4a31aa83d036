"""The engine process's options checked together (config.py): the per-device defaults decided, combinations that do
not go together refused with the options named, malformed values refused by the parser."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.config import ConfigError, EngineConfig
from engines.process import main as process
from engines.process.config import ProcessConfig
from engines.process.options import parser

TINY = ["--device", "cpu", "--model", "tiny-random", "--codec", "tiny-random", "--no-warm-up"]
NO_CODEC = ["--device", "cpu", "--model", "tiny-random", "--codec", "none", "--no-warm-up"]


def test_device_auto_is_the_gpu_when_there_is_one():
    assert ProcessConfig.parse(["--device", "auto"]).device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_options_left_unset_are_on_on_a_gpu_and_off_on_a_cpu():
    gpu, cpu = ProcessConfig.parse(["--device", "cuda:1"]), ProcessConfig.parse(["--device", "cpu"])
    assert (gpu.encoder_thread, gpu.warm_up, gpu.first_lane, gpu.kv_cache_gib) == (True, True, True, "auto")
    assert (cpu.encoder_thread, cpu.warm_up, cpu.first_lane, cpu.kv_cache_gib) == (False, False, False, None)
    assert gpu.on_gpu and gpu.kv_auto and not cpu.on_gpu and not cpu.kv_auto
    given = ProcessConfig.parse(["--device", "cuda", "--no-encoder-thread", "--no-warm-up", "--no-first-lane",
                                 "--kv-cache-gib", "8"])
    assert (given.encoder_thread, given.warm_up, given.first_lane, given.kv_cache_gib) == (False, False, False, 8.0)
    assert ProcessConfig.parse(["--device", "cpu", "--first-lane"]).first_lane


def test_engine_config_carries_the_engine_options():
    c = ProcessConfig.parse(NO_CODEC + ["--kv-cache-gib", "0.5", "--max-running", "300", "--max-model-len", "1024",
                                        "--ramp-step-rows", "96", "--kv-dtype", "fp8"]).engine_config()
    assert (c.device, c.dtype, c.kv_cache_bytes, c.max_running, c.max_model_len) == ("cpu", "float32", 2**29, 300, 1024)
    assert (c.prefill_token_budget, c.ramp_step_rows, c.kv_dtype) == (600, 96, "fp8")  # twice --max-running
    assert ProcessConfig.parse(NO_CODEC + ["--step-rows", "200"]).engine_config().prefill_token_budget == 200
    default = ProcessConfig.parse(NO_CODEC).engine_config()
    assert (default.kv_cache_bytes, default.prefill_token_budget) == (EngineConfig.kv_cache_bytes,
                                                                      EngineConfig.prefill_token_budget)
    # On a GPU the dtype is the model's (tiny-random's is float32; full-random's bfloat16).
    assert ProcessConfig.parse(["--device", "cuda", "--model", "full-random"]).engine_config().dtype == "bfloat16"


def test_options_that_do_not_go_together_are_refused():
    for argv, why in (
            (["--device", "cpu", "--kv-cache-gib", "auto"], "auto sizes the pool from a GPU's free memory"),
            (NO_CODEC + ["--max-running", "64", "--step-rows", "64"], r"--step-rows 64 must exceed .*--max-running 64"),
            (NO_CODEC + ["--step-rows", str(EngineConfig.max_running)], "--step-rows"),
            (TINY + ["--encoder-tf32"], "--encoder-tf32 needs a CUDA device"),
            (TINY + ["--decoder-context", "window", "--decoder-cache-gib", "4"], "--decoder-context window has none"),
            (TINY + ["--decoder-context", "window", "--decoder-cache-dtype", "fp8"], "window has none"),
            # A round size means nothing to rounds started once a period (they take every answer due).
            (TINY + ["--first-lane", "--codec-round-max", "24"], "--codec-round-period-ms 0"),
            (["--client-timeout-s", "0"], "--client-timeout-s must be > 0"),
            (["--gpu-window", "0,2,/tmp/w.npz"], "--gpu-window: .*>= 1")):
        with pytest.raises(ConfigError, match=why):
            ProcessConfig.parse(argv)
    # Without a codec there are no rounds: the round size is not refused.
    assert ProcessConfig.parse(NO_CODEC + ["--first-lane", "--codec-round-max", "24"]).codec_round_max == 24


def test_a_config_made_in_code_is_checked_too():
    config = ProcessConfig.parse(TINY)
    for change, why in (({"device": "auto"}, "--device auto"), ({"first_lanes": 0}, "--first-lanes must be >= 1"),
                        ({"encode_every_ms": float("nan")}, "--encode-every-ms must be a finite number"),
                        ({"kv_cache_gib": 0.0}, "--kv-cache-gib must be > 0")):
        with pytest.raises(ConfigError, match=why):
            dataclasses.replace(config, **change)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1


def test_malformed_values_are_refused_by_the_parser(capsys):
    p = parser()
    for opt, bad in (("--codec-round-max", "0"), ("--codec-round-max", "-3"), ("--codec-round-max", "many"),
                     ("--codec-round-period-ms", "-5"), ("--codec-round-period-ms", "nan"),
                     ("--codec-round-period-ms", "inf"), ("--codec-round-period-ms", "soon"),
                     ("--encode-every-ms", "-80"), ("--encode-every-ms", "nan"),
                     ("--ramp-step-rows", "-1"), ("--ramp-step-rows", "few"), ("--step-rows", "0"),
                     ("--kv-cache-gib", "0"), ("--kv-cache-gib", "-1"), ("--kv-cache-gib", "lots")):
        with pytest.raises(SystemExit):
            p.parse_args(TINY + [opt, bad])
        assert opt in capsys.readouterr().err
    assert p.parse_args(["--kv-cache-gib", "auto"]).kv_cache_gib == "auto"
    assert p.parse_args(["--kv-cache-gib", "8"]).kv_cache_gib == 8.0
    assert p.parse_args(TINY).encoder_tf32 is False  # float32 accuracy unless asked


def test_the_engine_process_refuses_options_that_do_not_go_together(capsys):
    """Before loading anything: status 2 and a usage message naming the options."""
    with pytest.raises(SystemExit) as e:
        process.main(["--device", "cpu", "--encoder-tf32", "--endpoint", "ipc:///tmp/moss-test-config.sock"])
    assert e.value.code == 2 and "--encoder-tf32 needs a CUDA device" in capsys.readouterr().err
