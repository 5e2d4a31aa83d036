"""Triton paged attention for rows that are the last position of their sequence (decode rows).

Split-KV ("flash decoding"): grid (seqs, kv_heads, splits). Each program takes one KV head's
query group over a slice of the sequence's context, reading K/V straight from the paged cache
through the block table, and keeps an online softmax; a second kernel merges the splits. The
split slice is computed in the kernel from the sequence's context length, so the launch shape
depends only on the batch size and can be captured in a CUDA graph.

Splits exist to give a small batch enough programs for the SMs; a large batch has them already, and
there extra splits only cost (each program's fixed work, empty splits of short contexts, a wider
merge): the split count falls with the batch (`num_splits`). With one split the split kernel writes the output itself
and no merge runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engines.kernels.cache_value import fp16_dots, kv_tile
from engines.kernels.pdl import launch_kwargs, trigger_then_wait, wait_then_trigger

MAX_SPLITS = 16
# Programs per SM the split count aims at (batch x KV heads x splits); batch 1 keeps MAX_SPLITS. None: always
# MAX_SPLITS (the split count before 2026-11-23 (15)). Over a cache in the query's dtype one program an SM, with the
# tilings below, took 0.69-0.98x the time of two with 64-row tiles at 1-16 sequences over 150-1,000-row contexts
# (H100, 2026-11-27); the fp8 cache's tilings were swept at two.
PROGRAMS_PER_SM: int | None = 1
FP8_PROGRAMS_PER_SM: int | None = 2
TILE = 64
# With one split the split kernel divides by the softmax sum and writes the output (the merge would compute the same
# quotient: bit-identical, GPU test). True: the merge runs anyway (engines/profiling/decode_ab.py times both).
MERGE_ONE_SPLIT = False
# (tile rows, warps, pipeline stages) of the split kernel. Over a 16-bit cache in the query's dtype: 32-row tiles at
# 8-16 splits (1-4 sequences: a split holds few rows), 128-row tiles at 1-4 splits while a launch has fewer than
# WIDE_MAX_PROGRAMS_PER_SM programs an SM (5-48 sequences), 64-row tiles above (64+ sequences: 128-row tiles were ~10%
# slower there) and over float32 caches (a 128-row float32 stage would not fit shared memory).
TILING = (TILE, 4, 2)
TILING_MANY_SPLITS = (32, 4, 2)
TILING_WIDE = (128, 4, 2)
WIDE_MAX_PROGRAMS_PER_SM = 3
# TILING_WIDE's K and V stages take 128 KiB of shared memory (Hopper lets a block have 227 KiB; many smaller GPUs ~100)
WIDE_MIN_SHARED_BYTES = 160 << 10
# Over an fp8 cache (its tiles are converted on their way to the dots): with 4 splits or fewer (16+ sequences on an
# H100) 2 warps a program were 1.2-1.8x faster than 4 over 1,000-4,000-row contexts; with 8-16 splits (1-8 sequences)
# 32-row tiles over 4 warps held 300-4,000-row contexts nearest the best (H100, 2026-11-27).
FP8_TILING = (TILE, 2, 2)
FP8_TILING_MANY_SPLITS = (32, 4, 2)
# The split kernel reads its first tile before the PDL wait only up to this many programs (batch x KV heads x
# splits); None: the device's SM count, so every program has an SM of its own (batch 1 on an H200: 128 programs on
# 132 SMs, 0.05 ms per step faster). With more programs, batches 4 to 64 measured 4-30% slower (2026-11-23).
PRELOAD_MAX_PROGRAMS: int | None = None


def num_splits(batch: int, kv_heads: int, device: torch.device, fp8: bool = False) -> int:
    """Splits of each (sequence, KV head)'s context: the power of two that gives every SM PROGRAMS_PER_SM programs
    (FP8_PROGRAMS_PER_SM over an fp8 cache) or more, at most MAX_SPLITS."""
    per_sm = FP8_PROGRAMS_PER_SM if fp8 else PROGRAMS_PER_SM
    if per_sm is None:
        return MAX_SPLITS
    want = -(-per_sm * _sm_count(device) // (batch * kv_heads))
    return min(MAX_SPLITS, triton.next_power_of_2(want))  # a power of two: the merge's tl.arange


def tiling(cache_dtype: torch.dtype, splits: int, programs: int, device: torch.device) -> tuple[int, int, int]:
    """(tile rows, warps, stages) of the split kernel over a cache of `cache_dtype` in a launch of `programs`."""
    if cache_dtype == torch.float8_e4m3fn:
        return FP8_TILING_MANY_SPLITS if splits >= 8 else FP8_TILING
    if splits >= 8:
        return TILING_MANY_SPLITS
    if (cache_dtype.itemsize == 2 and programs < WIDE_MAX_PROGRAMS_PER_SM * _sm_count(device)
            and _shared_memory(device) >= WIDE_MIN_SHARED_BYTES):
        return TILING_WIDE
    return TILING


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Shared memory a block may opt in to (0 where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _preload(device: torch.device, programs: int) -> bool:
    limit = PRELOAD_MAX_PROGRAMS if PRELOAD_MAX_PROGRAMS is not None else _sm_count(device)
    return programs <= limit


@triton.jit
def _tile_rows(BT, b, kvh, t0, end, stride_bt, stride_kb, stride_ks, stride_kh, PAGE: tl.constexpr,
               TILE_N: tl.constexpr, D: tl.constexpr):
    """Positions t0.. of a tile, which of them are before `end`, and their K/V element offsets [TILE, D] in the
    paged cache (through the block table)."""
    offs = t0 + tl.arange(0, TILE_N)
    ok = offs < end
    blk = tl.load(BT + b * stride_bt + offs // PAGE, mask=ok, other=0)
    rows = (blk.to(tl.int64) * stride_kb + (offs % PAGE) * stride_ks + kvh * stride_kh)[:, None]
    return offs, ok, rows + tl.arange(0, D)[None, :]


@triton.jit
def _attend_tile(q, k, v, t_mask, m, l_sum, acc, scale, PREC: tl.constexpr):
    """Online-softmax update of (running max, sum, weighted values) with one tile of keys/values [TILE, D]."""
    qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [GP, TILE] float32
    qk = tl.where(t_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    p = tl.exp(qk - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_sum, acc


@triton.jit
def _split_kernel(Q, K, V, BT, CTX, M_OUT, L_OUT, ACC_OUT, OUT, scale,
                  stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  TILE_N: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr, PRELOAD: tl.constexpr,
                  F16: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, GP)
    g_mask = offs_g < G
    heads = kvh * G + offs_g
    # The context lengths and block tables are copied in before a step's kernels: safe to read before the wait.
    ctx = tl.load(CTX + b)
    per_split = tl.cdiv(tl.cdiv(ctx, SPLITS), TILE_N) * TILE_N
    start = s * per_split
    end = tl.minimum(start + per_split, ctx)
    if PRELOAD:
        # Every cached row but a sequence's newest was written by earlier steps: the split's first tile is read
        # before the wait, while the kernels before this one (qkv GEMM, QK-norm) still run.
        offs_t, t_mask, rows = _tile_rows(BT, b, kvh, start, end, stride_bt, stride_kb, stride_ks, stride_kh, PAGE,
                                          TILE_N, D)
        k = kv_tile(tl.load(K + rows, mask=t_mask[:, None], other=0.0), Q, F16)  # [TILE, D]
        v = kv_tile(tl.load(V + rows, mask=t_mask[:, None], other=0.0), Q, F16)
    wait_then_trigger(PDL)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    if F16:
        q = q.to(tl.float16)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    first = start
    if PRELOAD:
        newest = ((offs_t == ctx - 1) & t_mask)[:, None]  # written by this step's K/V write: read again now
        k = tl.where(newest, kv_tile(tl.load(K + rows, mask=newest, other=0.0), Q, F16), k)
        v = tl.where(newest, kv_tile(tl.load(V + rows, mask=newest, other=0.0), Q, F16), v)
        if start < end:  # an empty split keeps (-inf, 0, 0): the merge gives it no weight
            m, l_sum, acc = _attend_tile(q, k, v, t_mask, m, l_sum, acc, scale, PREC)
        first = start + TILE_N
    for t0 in range(first, end, TILE_N):
        offs, ok, tile_rows = _tile_rows(BT, b, kvh, t0, end, stride_bt, stride_kb, stride_ks, stride_kh, PAGE,
                                         TILE_N, D)
        kt = kv_tile(tl.load(K + tile_rows, mask=ok[:, None], other=0.0), Q, F16)
        vt = kv_tile(tl.load(V + tile_rows, mask=ok[:, None], other=0.0), Q, F16)
        m, l_sum, acc = _attend_tile(q, kt, vt, ok, m, l_sum, acc, scale, PREC)

    if DIRECT:  # one split, so the whole context: the merge's quotient with weight exp(0) = 1
        out = acc / l_sum[:, None]
        tl.store(OUT + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=g_mask[:, None])
        return
    H = tl.num_programs(1) * G
    base = (b * H + heads) * SPLITS + s  # [GP]
    tl.store(M_OUT + base, m, mask=g_mask)
    tl.store(L_OUT + base, l_sum, mask=g_mask)
    tl.store(ACC_OUT + base[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _merge_kernel(M_IN, L_IN, ACC_IN, OUT, stride_ot, stride_oh, D: tl.constexpr, SPLITS: tl.constexpr,
                  PDL: tl.constexpr):
    trigger_then_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    base = (b * H + h) * SPLITS
    m = tl.load(M_IN + base + offs_s)
    l_sum = tl.load(L_IN + base + offs_s)
    acc = tl.load(ACC_IN + (base + offs_s)[:, None] * D + offs_d[None, :])
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # empty splits weigh nothing
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(OUT + b * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           splits: int | None = None) -> torch.Tensor:
    """q [B, heads, D] (one row per sequence, at its last position) -> [B, heads, D].

    k_cache, v_cache: [num_blocks, block_size, kv_heads, D] in q's dtype or fp8 (e4m3: `fp16_dots`); block_tables
    [B, max_blocks]; context_lens [B].
    splits: of each context, a power of two (default `num_splits`).
    """
    b, heads, d = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    g = heads // kvh
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    splits = splits or num_splits(b, kvh, q.device, fp8)
    q = q.contiguous()
    direct = splits == 1 and not MERGE_ONE_SPLIT
    out = torch.empty_like(q)
    if direct:  # (the split kernel's partial-result arguments, unused)
        m = l_sum = acc = out
    else:
        m = torch.empty(b, heads, splits, device=q.device, dtype=torch.float32)
        l_sum = torch.empty_like(m)
        acc = torch.empty(b, heads, splits, d, device=q.device, dtype=torch.float32)
    tile, warps, stages = tiling(k_cache.dtype, splits, b * kvh * splits, q.device)
    _split_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, block_tables, context_lens, m, l_sum, acc, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), G=g, GP=max(16, triton.next_power_of_2(g)), D=d, PAGE=page, TILE_N=tile,
        SPLITS=splits, PREC="ieee" if q.dtype == torch.float32 else "tf32",  # float32 caches keep full precision
        PRELOAD=_preload(q.device, b * kvh * splits), F16=fp16_dots(q, k_cache), DIRECT=direct, num_warps=warps,
        num_stages=stages,
        **launch_kwargs(q.device),
    )
    if direct:
        return out
    _merge_kernel[(b, heads)](m, l_sum, acc, out, out.stride(0), out.stride(1), D=d, SPLITS=splits, num_warps=4,
                              **launch_kwargs(q.device))
    return out
