"""Triton fusions of the small per-layer operations (GPU only; engines/lm/model/ops.py dispatches).

At decode batch sizes every elementwise op is a launch of a few microseconds; a layer had ~35
of them. These kernels keep the reference's rounding order (float32 math, rounded to the
activation dtype at the same points as the torch path) so GPU and CPU agree to bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engines.kernels.cache_value import cache_value
from engines.kernels.pdl import launch_kwargs, trigger_then_wait


@triton.jit
def _add_rmsnorm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_RES: tl.constexpr, PDL: tl.constexpr):
    trigger_then_wait(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(RES_OUT.dtype.element_ty)  # the residual stream is stored rounded, as the torch add does
        tl.store(RES_OUT + row * N + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * rstd).to(OUT.dtype.element_ty).to(tl.float32)  # round, then times the weight
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * N + offs, (y * w).to(OUT.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); x [T, N]."""
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if t:
        _add_rmsnorm_kernel[(t,)](x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
                                  residual.stride(0) if residual is not None else 0, eps, N=n,
                                  BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None, num_warps=8,
                                  **launch_kwargs(x.device))
    return out, res_out


@triton.jit
def _qk_norm_rope_kv_kernel(QKV, QW, KW, COS, SIN, Q_OUT, K_CACHE, V_CACHE, SLOTS, T, stride_qkv, stride_cos,
                            stride_slot_page, eps, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                            PAGE: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    trigger_then_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] token rows of this program
    h = tl.program_id(1)  # 0..H-1: q heads, H..H+KVH-1: k heads, then v heads
    r_ok = rows < T
    half = tl.arange(0, D // 2)
    m = r_ok[:, None]
    base = QKV + rows[:, None].to(tl.int64) * stride_qkv + h * D + half[None, :]  # [ROWS, D/2]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + D // 2, mask=m, other=0.0).to(tl.float32)
    slot = tl.load(SLOTS + rows, mask=r_ok, other=0).to(tl.int64)
    cache_row = ((slot // PAGE) * stride_slot_page + (slot % PAGE) * (KVH * D))[:, None] + half[None, :]
    if h >= H + KVH:  # v: straight into the cache
        v_dst = V_CACHE + cache_row + (h - H - KVH) * D
        tl.store(v_dst, cache_value(x1, V_CACHE.dtype.element_ty), mask=m)
        tl.store(v_dst + D // 2, cache_value(x2, V_CACHE.dtype.element_ty), mask=m)
    else:
        if h < H:
            w1 = tl.load(QW + half).to(tl.float32)
            w2 = tl.load(QW + D // 2 + half).to(tl.float32)
        else:
            w1 = tl.load(KW + half).to(tl.float32)
            w2 = tl.load(KW + D // 2 + half).to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)  # [ROWS]
        dt = Q_OUT.dtype.element_ty
        y1 = (x1 * rstd[:, None]).to(dt).to(tl.float32) * w1[None, :]
        y2 = (x2 * rstd[:, None]).to(dt).to(tl.float32) * w2[None, :]
        y1 = y1.to(dt).to(tl.float32)
        y2 = y2.to(dt).to(tl.float32)
        cs = rows[:, None].to(tl.int64) * stride_cos + half[None, :]
        c = tl.load(COS + cs, mask=m, other=0.0).to(tl.float32)  # cos/sin repeat per half
        s = tl.load(SIN + cs, mask=m, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as the torch path rounds it
        o1 = (y1 * c).to(dt).to(tl.float32) + (-y2 * s).to(dt).to(tl.float32)
        o2 = (y2 * c).to(dt).to(tl.float32) + (y1 * s).to(dt).to(tl.float32)
        if h < H:
            dst = Q_OUT + (rows[:, None].to(tl.int64) * H + h) * D + half[None, :]
            tl.store(dst, o1.to(dt), mask=m)
            tl.store(dst + D // 2, o2.to(dt), mask=m)
        else:
            k_dst = K_CACHE + cache_row + (h - H) * D
            # rounded to the model dtype first, as the torch path's key is before it is cached
            tl.store(k_dst, cache_value(o1.to(dt), K_CACHE.dtype.element_ty), mask=m)
            tl.store(k_dst + D // 2, cache_value(o2.to(dt), K_CACHE.dtype.element_ty), mask=m)


def qk_norm_rope_write_kv(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> q [T, H, D] normed and rotated; k (normed, rotated) and v written at their slots."""
    t = qkv.shape[0]
    d = q_w.shape[0]
    q = torch.empty(t, heads, d, device=qkv.device, dtype=qkv.dtype)
    if t:
        # Up to 16 rows of one head per program: one row per program made 24k one-warp programs for a 512-row
        # prefill (16 us per layer for 6 MB).
        rows = min(16, triton.next_power_of_2(t))
        _qk_norm_rope_kv_kernel[(triton.cdiv(t, rows), heads + 2 * kv_heads)](
            qkv, q_w, k_w, cos, sin, q, k_cache, v_cache, slots, t, qkv.stride(0), cos.stride(0), k_cache.stride(0),
            eps, H=heads, KVH=kv_heads, D=d, PAGE=k_cache.shape[1], ROWS=rows, num_warps=1 if rows < 4 else 4,
            **launch_kwargs(qkv.device))
    return q


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, F: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    trigger_then_wait(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + F + offs, mask=mask, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(OUT + row * F + offs, (s * u).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2F] -> silu(gate) * up, [T, F]."""
    t, f2 = gate_up.shape
    f = f2 // 2
    out = torch.empty(t, f, device=gate_up.device, dtype=gate_up.dtype)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(f, block))](gate_up, out, gate_up.stride(0), F=f, BLOCK=block, num_warps=4,
                                                     **launch_kwargs(gate_up.device))
    return out


@triton.jit
def _embed_rope_kernel(ROWS, POS, TEXT_W, AUDIO_W, INV_FREQ, X, COS, SIN, stride_rows, pad_id, H: tl.constexpr,
                       BLOCK_H: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    trigger_then_wait(PDL)
    row = tl.program_id(0)
    text = tl.load(ROWS + row * stride_rows).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    if text == pad_id:  # an audio row: its audio id is looked up (text rows may carry any audio id)
        audio = tl.load(ROWS + row * stride_rows + 1).to(tl.int64)
        x = tl.load(AUDIO_W + audio * H + offs, mask=mask, other=0.0)
    else:
        x = tl.load(TEXT_W + text * H + offs, mask=mask, other=0.0)
    tl.store(X + row * H + offs, x, mask=mask)
    # the angles in float32 as rope_cos_sin computes them, cos/sin as torch's (libdevice cosf/sinf), rounded once
    j = tl.arange(0, HALF)
    angle = tl.load(POS + row).to(tl.float32) * tl.load(INV_FREQ + j)
    c = libdevice.cos(angle).to(COS.dtype.element_ty)
    s = libdevice.sin(angle).to(SIN.dtype.element_ty)
    tl.store(COS + row * 2 * HALF + j, c)
    tl.store(COS + row * 2 * HALF + HALF + j, c)
    tl.store(SIN + row * 2 * HALF + j, s)
    tl.store(SIN + row * 2 * HALF + HALF + j, s)


def embed_rope(rows: torch.Tensor, positions: torch.Tensor, text_w: torch.Tensor, audio_w: torch.Tensor,
               inv_freq: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MossSpeechModel.embed and rope_cos_sin in one launch: rows [T, 2] -> (x [T, hidden], cos, sin
    [T, head_dim]), cos/sin in the embedding's dtype (13 small torch kernels at the start of every step before)."""
    t, h = rows.shape[0], text_w.shape[1]
    half = inv_freq.shape[0]
    x = torch.empty(t, h, device=rows.device, dtype=text_w.dtype)
    cos = torch.empty(t, 2 * half, device=rows.device, dtype=text_w.dtype)
    sin = torch.empty_like(cos)
    if t:
        _embed_rope_kernel[(t,)](rows, positions, text_w, audio_w, inv_freq, x, cos, sin, rows.stride(0), pad_id,
                                 H=h, BLOCK_H=triton.next_power_of_2(h), HALF=half, num_warps=4,
                                 **launch_kwargs(rows.device))
    return x, cos, sin
