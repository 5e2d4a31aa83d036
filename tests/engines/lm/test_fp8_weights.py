"""fp8 weights (engines/lm/model/fp8.py, fp8_copies.py): rounding that is exact in the model's dtype, and an engine
that is the dense reference over the rounded weights."""

from __future__ import annotations

import argparse

import pytest
import torch

from engines.config import ConfigError, EngineConfig
from engines.lm.engine import Engine
from engines.lm.loader.checkpoint import load_model
from engines.lm.model import fp8, fp8_copies
from engines.lm.model.layers import Linear
from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from tests.engines.lm.parity import assert_follows_reference, run_mixed_greedy
from tests.reference.dense_model import dense_from_state_dict, read_checkpoint_tensors


def _weights(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 300, generator=g) * torch.logspace(-6, 2, 48)[:, None]  # rows over 8 decades
    w[5] = 0.0
    w[7, :3] = torch.tensor([1e-9, -3e-12, 0.0])  # values far below their row's largest
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounding_is_exact_in_the_model_dtype_and_close_to_the_weight(dtype):
    w = _weights(0).to(dtype)
    w8, scale = fp8.quantize(w)
    assert w8.dtype == fp8.FP8 and scale.dtype == torch.float32 and scale.shape == (48,)
    # every scale a power of two, the all-zero row's 1
    mant, _ = torch.frexp(scale)
    assert (mant == 0.5).all() and scale[5] == 1.0
    assert (w8.float().abs() <= fp8.FP8_MAX).all() and not w8.float().isnan().any()
    # the largest magnitude of each row uses the upper half of e4m3's range: nothing wasted beyond one binade
    amax = w8.float().abs().amax(dim=1)
    assert (amax[torch.arange(48) != 5] >= fp8.FP8_MAX / 2).all()
    deq = fp8.dequantize(w8, scale, dtype)
    # exact: the dequantized value times 1 / scale is the fp8 value again, in float32 and in the model's dtype
    assert torch.equal(deq.float(), w8.float() * scale[:, None])
    # within e4m3's rounding (half of 2**-3 relative) for values in its normal range, subnormal step below
    err = (deq.float() - w.float()).abs()
    bound = torch.maximum(w.float().abs() * 2.0**-4, scale[:, None] * 2.0**-10)
    assert (err <= bound).all()
    # idempotent: rounded weights round to themselves (a row whose largest value rounded down to a binade's
    # bottom may take the scale below: the same values)
    assert torch.equal(fp8.dequantize(*fp8.quantize(deq), dtype), deq)


def test_round_weight_replaces_the_values_in_place():
    w = _weights(1).to(torch.bfloat16)
    before = w.clone()
    w8, scale = fp8.round_weight(w)
    assert torch.equal(w, fp8.dequantize(w8, scale, torch.bfloat16))
    assert not torch.equal(w, before)


@pytest.mark.parametrize("keep", [True, False])
def test_apply_gives_every_linear_its_copy_beside_or_instead_of_the_weight(tiny_checkpoint, keep):
    model = load_model(tiny_checkpoint, device="cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.config.num_attention_layers + 2  # qkv, o, gate_up, down; two heads
    rounded = [fp8.dequantize(*fp8.quantize(m.weight), m.weight.dtype) for m in linears]
    params_before = sum(p.numel() for p in model.parameters())
    nbytes = fp8_copies.apply(model, keep_weights=keep)
    assert nbytes == sum(r.numel() + 4 * r.shape[0] for r in rounded)
    for m, r in zip(linears, rounded, strict=True):
        w8, scale = m.fp8
        assert torch.equal(fp8.dequantize(w8, scale, r.dtype), r)
        assert torch.equal(m.weight, r) if keep else m.weight is None
    # without the weights they are gone from the module's parameters; a Linear on the CPU multiplies by the values
    gone = 0 if keep else sum(r.numel() for r in rounded)
    assert sum(p.numel() for p in model.parameters()) == params_before - gone
    x = torch.randn(3, linears[0].fp8[0].shape[1])
    assert torch.equal(linears[0](x), torch.nn.functional.linear(x, rounded[0]))
    half = load_model(tiny_checkpoint, device="cpu", dtype=torch.float16)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        fp8_copies.apply(half, keep_weights=keep)


def test_config_refuses_fp8_weights_in_float16_and_non_bools():
    assert EngineConfig(dtype="bfloat16", fp8_weights=True).fp8_weights
    with pytest.raises(ConfigError, match="fp8_weights needs dtype bfloat16 or float32"):
        EngineConfig(dtype="float16", fp8_weights=True)
    with pytest.raises(ConfigError, match="fp8_weights must be a bool"):
        EngineConfig(fp8_weights="yes")
    assert EngineConfig(fp8_weights=True, fp8_only=True).fp8_only
    with pytest.raises(ConfigError, match="fp8_only needs fp8_weights"):
        EngineConfig(fp8_only=True)
    with pytest.raises(ConfigError, match="fp8_only must be a bool"):
        EngineConfig(fp8_weights=True, fp8_only=1)


@pytest.mark.parametrize("keep", [True, False])
def test_engine_with_fp8_weights_is_the_dense_reference_over_the_rounded_weights(tiny_checkpoint, keep):
    """Greedy tokens on both channels equal the dense model's whose projection weights are the rounded ones (the
    rounding is per row, so the checkpoint's separate q/k/v and gate/up round as the engine's fused rows do); the
    unrounded dense model differs on some request."""
    tensors = read_checkpoint_tensors(tiny_checkpoint)
    rounded = {k: fp8.dequantize(*fp8.quantize(v), v.dtype) if k.endswith(("_proj.weight", "lm_head.weight")) else v
               for k, v in tensors.items()}
    model = load_model(tiny_checkpoint, device="cpu")
    # q, k, v, o, gate, up, down of every layer and the two heads changed; nothing else
    assert sum(not torch.equal(rounded[k], tensors[k]) for k in tensors) == 7 * model.config.num_attention_layers + 2
    fp8_copies.apply(model, keep_weights=keep)
    mc = model.config
    engine = Engine(model, mc, EngineConfig(kv_cache_bytes=mc.kv_bytes_per_row() * 4096, max_running=8,
                                            prefill_token_budget=48))
    reqs, got = run_mixed_greedy(engine, seed=7)
    assert_follows_reference(engine, reqs, got, dense_from_state_dict(mc, rounded), dense_from_state_dict(mc, tensors))


def test_fp8_weights_options_reach_the_engine():
    base = ["--device", "cpu", "--model", "tiny-random", "--codec", "none", "--no-warm-up"]
    for extra, copies, weights in (([], False, True), (["--fp8-weights"], True, True),
                                   (["--fp8-weights", "--fp8-only"], True, False)):
        svc = build_service(ProcessConfig.parse(base + extra))
        assert svc.engine.config.fp8_weights is copies and svc.engine.config.fp8_only is not weights
        linears = [m for m in svc.engine.runner.model.modules() if isinstance(m, Linear)]
        assert all((m.fp8 is not None) is copies and (m.weight is not None) is weights for m in linears), extra
    with pytest.raises(ConfigError, match="fp8_only needs fp8_weights"):
        build_service(ProcessConfig.parse(base + ["--fp8-only"]))


@pytest.mark.parametrize("keep", [True, False])
def test_bench_floor_counts_the_fp8_copies_where_steps_read_them(tiny_checkpoint, keep):
    from moss_speech.commands.bench_engine import matmul_params, weight_bytes

    model = load_model(tiny_checkpoint, device="cpu")
    full, params = weight_bytes(model, False), matmul_params(model)
    heads_and_layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.text_lm_head]
    linear_bytes = sum(m.weight.numel() * 4 for m in heads_and_layers)
    copy_bytes = sum(m.weight.numel() + 4 * m.weight.shape[0] for m in heads_and_layers)
    fp8_copies.apply(model, keep_weights=keep)
    assert weight_bytes(model, False, 1) == full - linear_bytes + copy_bytes
    # past fp8.MAX_ROWS rows cuBLAS reads the kept weights; without them the fp8 GEMM reads the copies
    assert weight_bytes(model, False, fp8.MAX_ROWS + 1) == (full if keep else full - linear_bytes + copy_bytes)
    assert matmul_params(model) == params  # the FLOP count of prefill is the copies' shapes


def test_bench_engine_refuses_fp8_only_beside_the_bf16_baseline():
    from moss_speech.commands.bench_engine import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit, match="--fp8-only needs --no-baseline"):
        run(p.parse_args(["--model", "tiny-random", "--device", "cpu", "--fp8-weights", "--fp8-only"]))
