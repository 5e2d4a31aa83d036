"""Paged attention, pure-torch path (CPU and fallback).

A GPU kernel can replace `write_kv` / `paged_attention` behind the same signatures; the one that does
(engines/kernels/lm/attention_gpu.py) is imported inside the CUDA branches: they need Triton, which a CPU-only machine
may lack.
Cache layer layout: k_cache, v_cache each [num_blocks, block_size, num_kv_heads, head_dim];
slot s lives at block s // block_size, offset s % block_size. The cache's element type is the model dtype or fp8
(EngineConfig.kv_dtype); attention reads it back in float32 here, in the model dtype on the GPU.
"""

from __future__ import annotations

import torch

from engines.config import cache_views
from engines.lm.model.batch import ForwardBatch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new rows' K/V ([T, kv_heads, head_dim]) at their slots."""
    kvh, d = k_cache.shape[-2:]
    for x, cache in ((k, k_cache), (v, v_cache)):
        x, cache = cache_views(x, cache)  # (index_copy_ has no fp8 kernel)
        cache.view(-1, kvh, d).index_copy_(0, slot_mapping, x)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                    scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention of each new row over its sequence's cached rows (its own included).

    q: [T, heads, head_dim] -> [T, heads, head_dim] in q's dtype. Row r of sequence i sees key positions
    0..positions[r] of that sequence, read through block_tables[i]. Scores and softmax in float32.
    """
    if q.is_cuda:
        from engines.kernels.lm.attention_gpu import paged_attention_cuda

        return paged_attention_cuda(q, k_cache, v_cache, batch, scale)
    t, heads, d = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    groups = heads // kvh
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    starts = batch.query_start.tolist()
    ctx_lens = batch.context_lens.tolist()
    for i, ctx in enumerate(ctx_lens):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        n_blocks = -(-ctx // block_size)
        blocks = batch.block_tables[i, :n_blocks]
        keys = k_cache[blocks].reshape(-1, kvh, d)[:ctx].float()  # [ctx, kv_heads, d]
        values = v_cache[blocks].reshape(-1, kvh, d)[:ctx].float()
        qi = q[lo:hi].float().view(hi - lo, kvh, groups, d)  # head h uses kv head h // groups
        scores = torch.einsum("nkgd,ckd->kgnc", qi, keys) * scale  # [kv_heads, groups, n, ctx]
        key_pos = torch.arange(ctx, device=q.device)
        allowed = key_pos[None, :] <= batch.positions[lo:hi, None]  # [n, ctx]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("kgnc,ckd->nkgd", probs, values).reshape(hi - lo, heads, d).to(q.dtype)
    return out
