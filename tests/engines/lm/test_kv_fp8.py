"""The fp8 KV cache (EngineConfig.kv_dtype = "fp8"): K/V stored as e4m3, saturated; an engine over it is the dense
reference whose attention reads K/V rounded the same way; the pool holds twice the rows of a bf16 one."""

from __future__ import annotations

import pytest
import torch

from engines.config import FP8_MAX, KV_DTYPES, ConfigError, EngineConfig, ModelConfig, to_cache
from engines.lm.engine import Engine
from engines.lm.kv.sizing import fit_kv_cache_bytes
from engines.lm.loader.checkpoint import load_model
from engines.lm.model.attention import write_kv
from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from engines.process.options import parser
from tests.engines.lm.parity import assert_follows_reference, run_mixed_greedy
from tests.reference.dense_generate import FP8_KV_MARGIN
from tests.reference.dense_model import dense_from_checkpoint

FP8 = torch.float8_e4m3fn


def test_config_names_the_cache_dtype_and_refuses_others():
    assert EngineConfig().kv_torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    assert EngineConfig(dtype="bfloat16", kv_dtype="fp8").kv_torch_dtype == FP8
    with pytest.raises(ConfigError, match="kv_dtype must be one of .*'fp8'.*got 'int8'"):
        EngineConfig(kv_dtype="int8")


def test_an_fp8_pool_holds_twice_the_rows_of_a_bf16_one():
    mc = ModelConfig()
    bf16 = EngineConfig(dtype="bfloat16", max_running=128, prefill_token_budget=512, max_model_len=4096)
    fp8 = EngineConfig(dtype="bfloat16", max_running=128, prefill_token_budget=512, max_model_len=4096,
                       kv_dtype="fp8")
    assert bf16.block_bytes(mc) == 2 * fp8.block_bytes(mc)
    free = 30 * 2**30
    assert fit_kv_cache_bytes(free, bf16, mc) // bf16.block_bytes(mc) * 2 == \
        fit_kv_cache_bytes(free, fp8, mc) // fp8.block_bytes(mc)


def test_values_are_stored_saturated_and_rounded_to_nearest_even():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, -3.3, 447.0, 449.0, 500.0, -1e4, 2.0**-9, 2.0**-11, float("inf")])
    got = to_cache(x, FP8).float()
    # 1.0625 lies halfway between 1.0 and 1.125: the even mantissa (1.0) wins; 1.1875 halfway to 1.25 (even)
    want = torch.tensor([0.0, 1.0, 1.0, 1.25, -3.25, 448.0, 448.0, 448.0, -448.0, 2.0**-9, 0.0, 448.0])
    assert torch.equal(got, want)
    assert to_cache(x, torch.bfloat16).dtype == torch.bfloat16  # a cache in the model dtype: a plain cast


def test_write_kv_stores_each_row_at_its_slot_in_an_fp8_cache():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g) * 300, torch.randn(5, 2, 8, generator=g)
    caches = [torch.zeros(4, 4, 2, 8, dtype=FP8) for _ in range(2)]
    slots = torch.tensor([3, 0, 14, 9, 6])
    write_kv(k, v, caches[0], caches[1], slots)
    for x, cache in zip((k, v), caches, strict=True):
        flat = cache.view(-1, 2, 8).float()
        assert torch.equal(flat[slots], x.clamp(-FP8_MAX, FP8_MAX).to(FP8).float())
        others = torch.ones(16, dtype=torch.bool)
        others[slots] = False
        assert not flat[others].any()
    assert caches[0].float().abs().max() == FP8_MAX  # some keys were beyond +-448


def test_engine_over_an_fp8_cache_is_the_dense_reference_over_rounded_keys_and_values(tiny_checkpoint):
    """Greedy tokens on both channels are the dense model's whose attention reads K/V rounded to e4m3 (near-ties
    within the e4m3 margin either way: which side of a rounding boundary a value lands on depends on the CPU's
    kernels); the dense model without the rounding is not followed on some request (the test sees the cache's
    numerics)."""
    model = load_model(tiny_checkpoint, device="cpu")
    mc = model.config
    cfg = EngineConfig(kv_cache_bytes=mc.kv_bytes_per_row(FP8) * 4096, max_running=8, prefill_token_budget=48,
                       kv_dtype="fp8")
    engine = Engine(model, mc, cfg)
    assert engine.runner.kv_cache.dtype == FP8
    reqs, got = run_mixed_greedy(engine, seed=11)
    assert_follows_reference(engine, reqs, got, dense_from_checkpoint(tiny_checkpoint, kv_fp8=True),
                             dense_from_checkpoint(tiny_checkpoint), margin=FP8_KV_MARGIN)


def test_kv_dtype_option_reaches_the_engine():
    p = parser()
    (choices,) = [a.choices for a in p._actions if a.dest == "kv_dtype"]
    assert sorted(choices) == sorted(KV_DTYPES)  # the process lists them without importing torch
    base = ["--device", "cpu", "--model", "tiny-random", "--codec", "none", "--no-warm-up"]
    for extra, dtype in (([], torch.float32), (["--kv-dtype", "fp8"], FP8)):
        svc = build_service(ProcessConfig.parse(base + extra))
        assert svc.engine.runner.kv_cache.dtype == dtype, extra
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--kv-dtype", "int8"])
