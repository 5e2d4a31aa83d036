"""Triton paged attention for any rows (prefill chunks, with or without a cached prefix, and decode rows).

Flash-attention forward over the paged cache: grid (tiles, heads). A tile is up to BLOCK_M consecutive new
rows of one sequence; the host lists the tiles (sequence, first row) and pads the list with sequence -1,
so the launch shape depends only on the padded tile count and the whole step can be captured in a CUDA
graph whatever the mix of chunk lengths. Row r sees keys 0..positions[r] of its sequence (causal over
cached prefix + new rows, like engines/lm/model/attention.py), read through the block table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.cache_value import fp16_dots, kv_tile
from engines.kernels.tiles import BLOCK_M, BLOCK_N


@triton.jit
def _varlen_kernel(Q, K, V, OUT, TILES, QSTART, POS, CTX, BT, scale, stride_tiles,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
                   G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   PREC: tl.constexpr, F16: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    scale_log2 = scale * 1.4426950408889634  # softmax with exp2: e^x = 2^(x log2 e)
    s = tl.load(TILES + tile)
    if s >= 0:
        r0 = tl.load(TILES + stride_tiles + tile)
        q0 = tl.load(QSTART + s)
        n = tl.load(QSTART + s + 1) - q0
        ctx = tl.load(CTX + s)
        kvh = h // G
        offs_m = r0 + tl.arange(0, BM)
        m_mask = offs_m < n
        offs_d = tl.arange(0, D)
        rows = (q0 + offs_m).to(tl.int64)
        q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_mask[:, None], other=0.0)
        if F16:
            q = q.to(tl.float16)  # dots in fp16 over an fp8 cache (cache_value.fp16_dots)
        pos = tl.load(POS + rows, mask=m_mask, other=-1)  # [BM]; padding rows see no key
        last = tl.minimum(r0 + BM, n) - 1
        hi = tl.minimum(ctx, tl.load(POS + q0 + last) + 1)
        m = tl.full([BM], float("-inf"), tl.float32)
        l_sum = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for t0 in range(0, hi, BN):
            offs_t = t0 + tl.arange(0, BN)
            t_mask = offs_t < hi
            blk = tl.load(BT + s * stride_bt + offs_t // PAGE, mask=t_mask, other=0)
            kv_row = blk.to(tl.int64) * stride_kb + (offs_t % PAGE) * stride_ks + kvh * stride_kh
            k = kv_tile(tl.load(K + kv_row[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0), Q,
                         F16)  # [BN, D]
            v = kv_tile(tl.load(V + kv_row[:, None] + offs_d[None, :], mask=t_mask[:, None], other=0.0), Q, F16)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # [BM, BN] float32, log2 units
            allowed = (offs_t[None, :] <= pos[:, None]) & t_mask[None, :]
            qk = tl.where(allowed, qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        tl.store(OUT + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=m_mask[:, None])


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: torch.Tensor,
                           query_start: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """q [T, heads, d]; k/v_cache [blocks, page, kv_heads, d] (q's dtype or fp8); tiles [2, n_tiles] (tile_map;
    rows may be a slice of a wider buffer, columns contiguous).
    Writes the rows the tiles cover into out [T, heads, d] (contiguous) and returns it."""
    t, heads, d = q.shape
    kvh, page = k_cache.shape[2], k_cache.shape[1]
    if q.stride() != out.stride():
        raise ValueError("q and out must have the same layout")
    n_tiles = tiles.shape[1]
    if t and n_tiles:
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        _varlen_kernel[(n_tiles, heads)](
            q, k_cache, v_cache, out, tiles, query_start, positions, context_lens, block_tables, scale, tiles.stride(0),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), G=heads // kvh, D=d, PAGE=page, BM=BLOCK_M, BN=BLOCK_N, PREC=prec,
            F16=fp16_dots(q, k_cache), num_warps=4, num_stages=2)
    return out
