"""Running out of GPU memory while the engine loads is a clear start-up error naming the parts and the options that
shrink them (an H100 with --kv-cache-gib 24 --max-running 128 ran out in the codec's graph capture), not a traceback."""

from __future__ import annotations

import logging

import pytest
import torch

from engines.config import ConfigError
from engines.process import main as process
from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from engines.process.observe.startup_memory import GIB, StartupMemory
from engines.speech_in.config import EncoderConfig
from engines.speech_in.slot_pool import KVPool

OOM = "CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 334 MiB"


def test_an_out_of_memory_error_names_the_part_what_came_before_and_the_options():
    held = [0]
    mem = StartupMemory("cuda:0", used=lambda: held[0], capacity=lambda: 80 * GIB)
    with mem.part("the language model and its KV pool"):
        held[0] += 41 * GIB
    with mem.part("the speech encoder's KV slots for 128 streams (234 MiB each)"):
        held[0] += 29 * GIB + GIB // 2
    with pytest.raises(ConfigError) as err, mem.part("the codec's CUDA graphs for batches of up to 128"):
        raise torch.OutOfMemoryError(OOM)
    msg = str(err.value)
    assert msg.startswith("out of GPU memory on cuda:0 (80.0 GiB) while loading the codec's CUDA graphs for batches "
                          "of up to 128 (CUDA out of memory. Tried to allocate 384.00 MiB)")
    assert ("loaded before: the language model and its KV pool 41.0 GiB, the speech encoder's KV slots for 128 streams "
            "(234 MiB each) 29.5 GiB") in msg
    assert "--kv-cache-gib" in msg and "--decoder-cache-gib" in msg and "--max-running" in msg
    assert [name for name, _ in mem.parts] == ["the language model and its KV pool",
                                                "the speech encoder's KV slots for 128 streams (234 MiB each)"]


def test_each_part_is_logged_with_its_time_and_memory(caplog):
    now, held = [0.0], [0]
    mem = StartupMemory("cuda:0", used=lambda: held[0], capacity=lambda: 80 * GIB, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="engines.process"), mem.part("the codec decoder"):
        now[0] += 42.5
        held[0] += 3 * GIB
    assert "start-up: the codec decoder in 42.5 s (3.00 GiB)" in caplog.text


def test_other_errors_pass_through_unchanged():
    mem = StartupMemory("cpu")
    with pytest.raises(ValueError, match="bad checkpoint"), mem.part("the speech encoder"):
        raise ValueError("bad checkpoint")
    with mem.part("nothing"):
        pass
    assert mem.parts == [("nothing", 0)]


def test_slot_bytes_is_what_a_slot_allocates():
    cfg = EncoderConfig(d_model=64, num_heads=4, ffn_dim=128, num_layers=3, total_layers=3, max_source_positions=48)
    pool = KVPool(cfg, torch.float32, torch.device("cpu"))
    pool.reserve(3)
    allocated = sum(t.numel() * t.element_size() for t in pool.keys + pool.values)
    assert allocated == (3 + 1) * pool.slot_bytes()  # (+ the spare slot)
    full = KVPool(EncoderConfig(), torch.float32, torch.device("cpu"))
    assert full.slot_bytes() == 1500 * 1280 * 2 * 16 * 4  # 234 MiB: what the README's memory table says


def test_the_engine_process_exits_with_the_message_when_a_part_runs_out(monkeypatch, caplog):
    from engines.speech_out.decoder import CodecDecoder

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(CodecDecoder, "load", classmethod(lambda cls, *a, **kw: no_memory()))
    with caplog.at_level(logging.ERROR, logger="engines.process"):
        rc = process.main(["--model", "tiny-random", "--codec", "tiny-random", "--device", "cpu", "--no-warm-up",
                           "--endpoint", "ipc:///tmp/moss-test-startup-memory.sock"])
    assert rc == 2
    msg = "\n".join(r.getMessage() for r in caplog.records)
    assert ("cannot start the engine: out of GPU memory on cpu while loading the codec decoder and its cache of "
            "earlier chunks (--decoder-cache-gib)") in msg
    assert "loaded before: the language model's weights 0.0 GiB, the speech encoder 0.0 GiB;" in msg


def test_kv_pool_auto_takes_the_free_memory_less_the_headroom_capped_at_what_sequences_can_use():
    from engines.config import EngineConfig, model_config_for
    from engines.lm.kv.sizing import fit_kv_cache_bytes

    mc = model_config_for("full-random")
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_running=128, max_model_len=4096)
    per_block = 160 * 1024 * 16  # 160 KiB per row (README), 16 rows a block
    assert mc.kv_bytes_per_row(torch.bfloat16) * 16 == per_block
    # An H100 after the codec's parts and the weights: ~21 GiB free.
    got = fit_kv_cache_bytes(21 * GIB + 12345, cfg, mc, headroom_bytes=6 * GIB)
    assert got % per_block == 0 and 15 * GIB - per_block < got <= 15 * GIB
    # Never more than max_running sequences of max_model_len rows could fill.
    assert fit_kv_cache_bytes(500 * GIB, cfg, mc, headroom_bytes=6 * GIB) == 128 * (4096 // 16) * per_block
    with pytest.raises(ConfigError, match=r"--max-model-len 4096 rows needs 0.62 GiB: lower --max-model-len"):
        fit_kv_cache_bytes(6 * GIB + GIB // 2, cfg, mc, headroom_bytes=6 * GIB)


def test_the_engine_sizes_its_pool_from_the_free_memory_it_is_given():
    from engines.config import EngineConfig
    from engines.lm.engine import Engine

    cfg = EngineConfig(device="cpu", dtype="float32", max_running=4, max_model_len=64)
    plain = Engine.from_name("tiny-random", cfg)
    per_block = plain.model_config.kv_bytes_per_row(torch.float32) * cfg.block_size
    free = 6 * GIB + 10 * per_block + 7  # the default headroom and 10 blocks
    auto = Engine.build(*Engine.load_weights("tiny-random", cfg), cfg, kv_free_bytes=free)
    assert auto.config.kv_cache_bytes == 10 * per_block and auto.stats().total_blocks == 10
    assert plain.config.kv_cache_bytes == cfg.kv_cache_bytes


def test_a_kv_pool_of_few_rows_per_running_sequence_is_warned_about(caplog):
    """An H100 with --fp8-weights left a 2.2 GiB pool at --max-running 128 (~112 rows a sequence), and every turn of
    60 sessions was refused (2026-11-24); the bf16 pool of 9.9 GiB (~500 rows a sequence) served them."""
    from engines.config import EngineConfig, model_config_for
    from engines.lm.kv.sizing import THIN_ROWS_PER_SEQUENCE, thin_pool_warning

    mc = model_config_for("full-random")
    cfg = EngineConfig(device="cpu", dtype="bfloat16", max_running=128, max_model_len=4096)
    msg = thin_pool_warning(int(2.2 * GIB), cfg, mc)
    assert msg is not None and "14417 rows, 112 per running sequence at --max-running 128" in msg
    assert thin_pool_warning(int(9.9 * GIB), cfg, mc) is None
    edge = THIN_ROWS_PER_SEQUENCE * 128 * mc.kv_bytes_per_row(torch.bfloat16)
    assert thin_pool_warning(edge, cfg, mc) is None and thin_pool_warning(edge - 1, cfg, mc) is not None
    base = ["--device", "cpu", "--model", "tiny-random", "--codec", "none", "--no-warm-up", "--max-running", "8"]
    with caplog.at_level("WARNING", logger="engines.process"):
        build_service(ProcessConfig.parse(base + ["--kv-cache-gib", "0.001"]))
    assert "per running sequence at --max-running 8" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="engines.process"):
        build_service(ProcessConfig.parse(base))
    assert "per running sequence" not in caplog.text
