"""Running out of GPU memory while the engine loads is a clear start-up error naming the parts and the options that
shrink them (an H100 with --kv-cache-gib 24 --max-running 128 ran out in the codec's graph capture), not a traceback."""

from __future__ import annotations

import logging

import pytest
import torch

from engines.codec.encoder.config import EncoderConfig
from engines.codec.encoder.kv_pool import KVPool
from engines.config import ConfigError
from engines.service import process
from engines.service.startup_memory import GIB, StartupMemory

OOM = "CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 334 MiB"


def test_an_out_of_memory_error_names_the_part_what_came_before_and_the_options():
    held = [0]
    mem = StartupMemory("cuda:0", allocated=lambda: held[0], capacity=lambda: 80 * GIB)
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
    assert "--kv-cache-gib" in msg and "--max-running" in msg
    assert [name for name, _ in mem.parts] == ["the language model and its KV pool",
                                                "the speech encoder's KV slots for 128 streams (234 MiB each)"]


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
    from engines.codec.encoder import SpeechEncoder

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(SpeechEncoder, "load", classmethod(lambda cls, *a, **kw: no_memory()))
    with caplog.at_level(logging.ERROR, logger="engines.service"):
        rc = process.main(["--model", "tiny-random", "--codec", "tiny-random", "--device", "cpu", "--no-warm-up",
                           "--endpoint", "ipc:///tmp/moss-test-startup-memory.sock"])
    assert rc == 2
    msg = "\n".join(r.getMessage() for r in caplog.records)
    assert "cannot start the engine: out of GPU memory on cpu while loading the speech encoder" in msg
    assert "loaded before: the language model and its KV pool 0.0 GiB" in msg
