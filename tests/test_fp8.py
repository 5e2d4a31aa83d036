"""fp8 weights (engines/model/fp8.py): rounding that is exact in the model's dtype, and an engine that is the dense
reference over the rounded weights."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from engines.config import ConfigError, EngineConfig
from engines.engine import Engine
from engines.loader.checkpoint import load_model
from engines.model import fp8
from engines.model.layers import Linear
from tests.reference.dense_generate import dense_greedy
from tests.reference.dense_model import dense_from_state_dict, read_checkpoint_tensors
from tests.test_engine import STEPS, greedy, make_prompt


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


def test_apply_gives_every_linear_its_copy_and_refuses_float16(tiny_checkpoint):
    model = load_model(tiny_checkpoint, device="cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.config.num_attention_layers + 2  # qkv, o, gate_up, down; two heads
    nbytes = fp8.apply(model)
    assert nbytes == sum(m.weight.numel() + 4 * m.weight.shape[0] for m in linears)
    for m in linears:
        w8, scale = m.fp8
        assert w8.shape == m.weight.shape and torch.equal(fp8.dequantize(w8, scale, m.weight.dtype), m.weight)
    half = load_model(tiny_checkpoint, device="cpu", dtype=torch.float16)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        fp8.apply(half)


def test_config_refuses_fp8_weights_in_float16_and_non_bools():
    assert EngineConfig(dtype="bfloat16", fp8_weights=True).fp8_weights
    with pytest.raises(ConfigError, match="fp8_weights needs dtype bfloat16 or float32"):
        EngineConfig(dtype="float16", fp8_weights=True)
    with pytest.raises(ConfigError, match="fp8_weights must be a bool"):
        EngineConfig(fp8_weights="yes")


def test_engine_with_fp8_weights_is_the_dense_reference_over_the_rounded_weights(tiny_checkpoint):
    """Greedy tokens on both channels equal the dense model's whose projection weights are the rounded ones (the
    rounding is per row, so the checkpoint's separate q/k/v and gate/up round as the engine's fused rows do); the
    unrounded dense model differs on some request."""
    tensors = read_checkpoint_tensors(tiny_checkpoint)
    rounded = {k: fp8.dequantize(*fp8.quantize(v), v.dtype) if k.endswith(("_proj.weight", "lm_head.weight")) else v
               for k, v in tensors.items()}
    model = load_model(tiny_checkpoint, device="cpu")
    # q, k, v, o, gate, up, down of every layer and the two heads changed; nothing else
    assert sum(not torch.equal(rounded[k], tensors[k]) for k in tensors) == 7 * model.config.num_attention_layers + 2
    fp8.apply(model)
    mc = model.config
    engine = Engine(model, mc, EngineConfig(kv_cache_bytes=mc.kv_bytes_per_row() * 4096, max_running=8,
                                            prefill_token_budget=48))
    rng = random.Random(7)
    kinds = ["text", "audio_in", "audio_out", "audio_in_audio_out"]
    reqs = {f"r{i}": make_prompt(rng, kinds[i % 4]) for i in range(8)}
    got: dict[str, list] = {rid: [] for rid in reqs}
    for rid, rows in reqs.items():
        engine.add_request(rid, rows, greedy(min_new=STEPS if "audio_out" in rid else 0))
    while engine.has_work():
        for o in engine.step():
            got[o.request_id].append((o.text_token, o.audio_token, o.mode))
        engine.check_integrity()
    dense = dense_from_state_dict(mc, rounded)
    plain = dense_from_state_dict(mc, tensors)
    assert all(got[rid] == dense_greedy(dense, rows, STEPS) for rid, rows in reqs.items())
    assert any(got[rid] != dense_greedy(plain, rows, STEPS) for rid, rows in reqs.items())
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_fp8_weights_option_reaches_the_engine():
    from engines.service.process import add_arguments, build_service

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--device", "cpu", "--model", "tiny-random", "--codec", "none", "--no-warm-up"]
    for extra, want in (([], False), (["--fp8-weights"], True)):
        svc = build_service(p.parse_args(base + extra))
        assert svc.engine.config.fp8_weights is want
        linears = [m for m in svc.engine.runner.model.modules() if isinstance(m, Linear)]
        assert all((m.fp8 is not None) is want for m in linears)


def test_bench_floor_counts_the_fp8_copies_where_decode_steps_read_them(tiny_checkpoint):
    from engines.commands.bench_engine import weight_bytes

    model = load_model(tiny_checkpoint, device="cpu")
    full = weight_bytes(model, False)
    fp8.apply(model)
    linear_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, Linear)
                       and m is not model.text_lm_head)
    copy_bytes = sum(m.weight.numel() + 4 * m.weight.shape[0] for m in model.modules() if isinstance(m, Linear)
                     and m is not model.text_lm_head)
    assert weight_bytes(model, False, fp8.MAX_ROWS + 1) == full
    assert weight_bytes(model, False, 1) == full - linear_bytes + copy_bytes
