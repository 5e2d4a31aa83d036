"""CUDA attention over the paged cache: Triton split-KV kernel for decode rows, SDPA for prefill chunks.

Decode rows come first in the batch (the runner orders them), so one kernel launch covers them
all without any host sync: that part is what CUDA graphs capture. Prefill chunks gather their
sequence's K/V from the cache and run torch's fused attention (flash when the chunk has no cached
prefix, memory-efficient with an offset causal mask when it has one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.kernels.paged_decode import paged_decode_attention
from engines.model.batch import ForwardBatch


def paged_attention_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                         scale: float | None = None) -> torch.Tensor:
    t, heads, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    nd = batch.num_decode_seqs
    if nd == batch.num_seqs:
        return paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, batch.block_tables[:nd],
                                          batch.context_lens[:nd], scale)
    starts, ctxs = batch.query_start_host, batch.context_lens_host
    if starts is None or ctxs is None:
        starts, ctxs = batch.query_start.tolist(), batch.context_lens.tolist()
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    for i in range(nd, batch.num_seqs):
        lo, hi, ctx = starts[i], starts[i + 1], ctxs[i]
        n = hi - lo
        blocks = batch.block_tables[i, : -(-ctx // page)]
        keys = k_cache[blocks].reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]  # [1, kv_heads, ctx, d]
        values = v_cache[blocks].reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]
        qi = q[lo:hi].transpose(0, 1)[None]  # [1, heads, n, d]
        if n == ctx:
            o = F.scaled_dot_product_attention(qi, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # rows are the last n positions: row r sees keys 0..ctx-n+r
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
            o = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
    return out
