"""Triton fusions of the small per-layer operations (GPU only; engines/model/ops.py dispatches).

At decode batch sizes every elementwise op is a launch of a few microseconds; a layer had ~35
of them. These kernels keep the reference's rounding order (float32 math, rounded to the
activation dtype at the same points as the torch path) so GPU and CPU agree to bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(X, R, W, OUT, RES_OUT, stride_x, stride_r, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_RES: tl.constexpr):
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
                                  BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None, num_warps=8)
    return out, res_out


@triton.jit
def _qk_norm_rope_kv_kernel(QKV, QW, KW, COS, SIN, Q_OUT, K_CACHE, V_CACHE, SLOTS, stride_qkv, stride_cos,
                            stride_slot_page, eps, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                            PAGE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # 0..H-1: q heads, H..H+KVH-1: k heads, then v heads
    half = tl.arange(0, D // 2)
    base = QKV + t * stride_qkv + h * D
    x1 = tl.load(base + half).to(tl.float32)
    x2 = tl.load(base + D // 2 + half).to(tl.float32)
    slot = tl.load(SLOTS + t)
    cache_row = (slot // PAGE) * stride_slot_page + (slot % PAGE) * (KVH * D)
    if h >= H + KVH:  # v: straight into the cache
        dst = V_CACHE + cache_row + (h - H - KVH) * D
        tl.store(dst + half, x1.to(V_CACHE.dtype.element_ty))
        tl.store(dst + D // 2 + half, x2.to(V_CACHE.dtype.element_ty))
    else:
        if h < H:
            w1 = tl.load(QW + half).to(tl.float32)
            w2 = tl.load(QW + D // 2 + half).to(tl.float32)
        else:
            w1 = tl.load(KW + half).to(tl.float32)
            w2 = tl.load(KW + D // 2 + half).to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        dt = Q_OUT.dtype.element_ty
        y1 = (x1 * rstd).to(dt).to(tl.float32) * w1
        y2 = (x2 * rstd).to(dt).to(tl.float32) * w2
        y1 = y1.to(dt).to(tl.float32)
        y2 = y2.to(dt).to(tl.float32)
        c = tl.load(COS + t * stride_cos + half).to(tl.float32)  # cos/sin repeat per half
        s = tl.load(SIN + t * stride_cos + half).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as the torch path rounds it
        o1 = (y1 * c).to(dt).to(tl.float32) + (-y2 * s).to(dt).to(tl.float32)
        o2 = (y2 * c).to(dt).to(tl.float32) + (y1 * s).to(dt).to(tl.float32)
        if h < H:
            dst = Q_OUT + (t * H + h) * D
        else:
            dst = K_CACHE + cache_row + (h - H) * D
        tl.store(dst + half, o1.to(dt))
        tl.store(dst + D // 2 + half, o2.to(dt))


def qk_norm_rope_write_kv(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          heads: int, kv_heads: int, eps: float) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] -> q [T, H, D] normed and rotated; k (normed, rotated) and v written at their slots."""
    t = qkv.shape[0]
    d = q_w.shape[0]
    q = torch.empty(t, heads, d, device=qkv.device, dtype=qkv.dtype)
    if t:
        _qk_norm_rope_kv_kernel[(t, heads + 2 * kv_heads)](
            qkv, q_w, k_w, cos, sin, q, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0), k_cache.stride(0),
            eps, H=heads, KVH=kv_heads, D=d, PAGE=k_cache.shape[1], num_warps=1)
    return q


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, F: tl.constexpr, BLOCK: tl.constexpr):
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
        _silu_mul_kernel[(t, triton.cdiv(f, block))](gate_up, out, gate_up.stride(0), F=f, BLOCK=block, num_warps=4)
    return out
