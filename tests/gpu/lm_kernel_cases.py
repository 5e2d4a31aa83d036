"""Shared cases of the LM kernel tests under tests/gpu: random paged-attention batches and their float64 torch
reference, the decode kernel's preload switch, a tiling launch that tells a tiling too large for this GPU, and full-size
decoder layers over a decode batch."""

from __future__ import annotations

import random

import pytest
import torch

from engines.lm.model.attention import paged_attention
from engines.lm.model.batch import ForwardBatch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def make_case(seed: int, block_size: int, q_lens: list[int], ctx_lens: list[int], dtype, heads=32, kvh=8, d=128):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # non-contiguous tables
    tables, k = [], 0
    for n in blocks_needed:
        tables.append(perm[k:k + n])
        k += n
    width = max(blocks_needed)
    cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=g).to(dtype).cuda()
    positions, qstart = [], [0]
    for q, c in zip(q_lens, ctx_lens, strict=True):
        positions += list(range(c - q, c))
        qstart.append(qstart[-1] + q)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device="cuda")
    batch = ForwardBatch(
        rows=torch.zeros(len(positions), 2, dtype=torch.long, device="cuda"), positions=as_long(positions),
        slot_mapping=as_long([0] * len(positions)), query_start=as_long(qstart), context_lens=as_long(ctx_lens),
        block_tables=as_long([t + [0] * (width - len(t)) for t in tables]), logits_rows=as_long([]),
        max_query_len=max(q_lens), max_context_len=max(ctx_lens), is_decode=all(q == 1 for q in q_lens),
        num_decode_seqs=next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens)),
        query_start_host=qstart, context_lens_host=ctx_lens)
    q = torch.randn(len(positions), heads, d, generator=g).to(dtype).cuda()
    return q, cache, batch


def torch_reference(q, cache, batch):
    cpu = ForwardBatch(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})
    return paged_attention(q.double().cpu(), cache[0].double().cpu(), cache[1].double().cpu(), cpu)


# The decode kernel's two ways to start: the first tile read after the PDL wait, or before it (where every program
# has an SM of its own; forced on here for every batch).
PRELOAD_LIMITS = pytest.mark.parametrize("preload_limit", [0, 1 << 30], ids=["after-wait", "preload"])


MIXED_CASES = [([1, 1, 40, 23], [300, 9, 40, 140]),  # decode rows, a fresh prefill, a chunk on a cached prefix
               ([512], [512]),  # one long fresh prefill: 16 tiles
               ([1, 33, 65, 1000], [4000, 1000, 65, 1130])]


def _torch_rmsnorm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def launch_tiling(*args, launch=None, **kwargs) -> torch.Tensor | None:
    """skinny_gemm.launch (or `launch`, another kernel's), or None for a tiling too large for this GPU (the tuners
    skip those too)."""
    from engines.kernels.lm import skinny_gemm

    try:
        return (launch or skinny_gemm.launch)(*args, **kwargs)
    except Exception as e:
        if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
            return None
        raise


def full_size_layers(rows: int, n: int = 4):
    """`n` full-size decoder layers with random weights over a decode batch of `rows` sequences (contexts of
    1-1500 rows): (layers, x [rows, hidden], per-layer caches, the initial cache, the batch, forward() -> the last
    layer's output). The GEMM shapes are tuned, then forced to their best Triton tiling with one pass over K (the
    one gate_up's SiLU*up epilogue needs), whatever the tuner chose."""
    from engines.config import model_config_for
    from engines.kernels.lm import skinny_gemm
    from engines.lm.model.layers import DecoderLayer
    from engines.lm.model.rope import rope_cos_sin, rope_inv_freq

    mc = model_config_for("full-random")
    g = torch.Generator(device="cuda").manual_seed(11)
    layers = [DecoderLayer(mc, "cuda", torch.bfloat16) for _ in range(n)]
    for layer in layers:
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, device="cuda", generator=g) * (0.02 if p.dim() == 2 else 1.0) + (
                1.0 if p.dim() == 1 else 0.0))
    ctx = [700, 1, 1500, 33, 1024, 5, 900, 64][:rows] + [1] * max(0, rows - 8)
    q, cache, batch = make_case(13, 16, [1] * rows, ctx, torch.bfloat16, heads=mc.num_attention_heads,
                                kvh=mc.num_key_value_heads, d=mc.head_dim)
    kv = [cache.clone() for _ in layers]
    batch.slot_mapping.copy_(batch.block_tables[torch.arange(rows), (batch.context_lens - 1) // 16] * 16
                             + (batch.context_lens - 1) % 16)
    positions = batch.context_lens - 1
    cos, sin = rope_cos_sin(positions, rope_inv_freq(mc.head_dim, mc.rope_theta).cuda(), torch.bfloat16)
    x = torch.randn(rows, mc.hidden_size, device="cuda", generator=g).to(torch.bfloat16)

    def forward():
        h, r = x, None
        for layer, c in zip(layers, kv, strict=True):
            h, r = layer(h, r, cos, sin, c, batch)
        return h + r

    l0 = layers[0]  # tune the GEMM shapes outside any capture
    for lin in (l0.qkv_proj, l0.o_proj, l0.gate_up_proj, l0.down_proj):
        skinny_gemm.tune(lin.weight)
        key = (*lin.weight.shape, torch.bfloat16, skinny_gemm.MAX_ROWS)
        t = skinny_gemm.timings[key]
        skinny_gemm._choice[key] = min(
            (c for c in t if c != "cublas" and c[4] == 1), key=t.__getitem__)
    return layers, x, kv, cache, batch, forward
