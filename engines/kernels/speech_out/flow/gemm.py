"""GEMMs of the codec estimator at streaming row counts:
- `ln_linear`: add + LayerNorm as the prologue of the GEMM after it (+ bias, + GELU).
- `linear`: the to_out and ff output GEMMs (one whole-K weight tile per program; + the residual stream in the
  epilogue for the last block of a stack).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engines.kernels.pdl import wait_then_trigger
from engines.kernels.speech_out.flow.common import STREAM_TILES, launch_for, mma
from engines.kernels.speech_out.flow.norms import add_layernorm, layernorm_f32


@triton.jit
def _gelu_f32(y):
    return 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))


@triton.jit(do_not_specialize=["M"])
def _ln_linear_kernel(X, R, LNW, LNB, WT, BIAS, Y, S, M, N, eps, C: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                      IEEE: tl.constexpr, PDL: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.arange(0, C)
    mm = rm < M
    dt = Y.dtype.element_ty
    # The weights are read before the wait: nothing in a step writes them, and their loads (HBM misses: the
    # estimator's weights do not fit L2) then overlap the previous kernel's tail.
    lnw = tl.load(LNW + rc).to(tl.float32)
    lnb = tl.load(LNB + rc).to(tl.float32)
    w = tl.load(WT + rc[:, None] * N + rn[None, :], mask=(rn < N)[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
    wait_then_trigger(PDL)
    x = tl.load(X + rm[:, None] * C + rc[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
    if HAS_RES:
        x = (x + tl.load(R + rm[:, None] * C + rc[None, :], mask=mm[:, None], other=0.0).to(tl.float32)).to(dt)
        x = x.to(tl.float32)
        if tl.program_id(1) == 0:  # one column block stores the residual stream
            tl.store(S + rm[:, None] * C + rc[None, :], x.to(dt), mask=mm[:, None])
    h = layernorm_f32(x, (rc < C)[None, :], lnw, lnb, eps, C).to(dt)  # LayerNorm output, stored rounded by torch
    acc = mma(h, w, IEEE)
    if HAS_BIAS:
        acc += bias[None, :]
    y = acc.to(dt)
    if GELU:
        y = _gelu_f32(y.to(tl.float32)).to(dt)
    tl.store(Y + rm[:, None] * N + rn[None, :], y, mask=mm[:, None] & (rn < N)[None, :])


# Above this many rows the LayerNorm prologue, redone by every column block, costs more than the separate LayerNorm
# kernel it saves (a tile sweep on an H200, C 256, N 1024-1536: fused 3.2-3.3 us vs 4.4-6.3 at 80
# rows, 5.9-7.2 vs 5.9-7.6 at 640, 9.3-11.4 vs 7.3-9.4 at 1280), so larger batches take add_layernorm + cuBLAS.
LN_LINEAR_MAX_ROWS = 640


def ln_linear(x: torch.Tensor, residual: torch.Tensor | None, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
              eps: float, w_t: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual, y = [gelu](LayerNorm(s) @ w_t + bias) in one kernel (the whole row of C channels is one
    GEMM operand tile, so the LayerNorm is the GEMM's prologue). x, residual [B, T, C]; w_t [C, N] (the Linear
    weight transposed). Returns (y [B, T, N], s [B, T, C]); s is x itself when residual is None. GELU is the exact
    (erf) one, applied to the rounded GEMM output as F.gelu(linear(...)) does. Over LN_LINEAR_MAX_ROWS rows: the
    unfused kernels."""
    nb, t, c = x.shape
    n = w_t.shape[1]
    if w_t.shape[0] != c:
        raise ValueError(f"weight {tuple(w_t.shape)} does not take {c} channels")
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(nb, t, n, device=x.device, dtype=x.dtype)
    s = x
    if residual is not None:
        residual = residual if residual.is_contiguous() else residual.contiguous()
        s = torch.empty_like(x)
    m = nb * t
    if m > LN_LINEAR_MAX_ROWS:
        h, s = add_layernorm(x, residual, ln_weight, ln_bias, eps)
        y = F.linear(h, w_t.t(), bias)
        return (F.gelu(y) if gelu else y), s
    if m:
        bm, bn, warps = STREAM_TILES.ln_linear if m <= 128 else (32, 128, 8) if m <= 320 else (64, 128, 8)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _ln_linear_kernel[grid](x, residual if residual is not None else x, ln_weight, ln_bias, w_t,
                                bias if bias is not None else ln_bias, y, s, m, n, eps, C=c, BLOCK_M=bm,
                                BLOCK_N=bn, HAS_RES=residual is not None, HAS_BIAS=bias is not None, GELU=gelu,
                                IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=1,
                                **launch_for(x.device, nb * t))
    return y, s


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, BIAS, RES, Y, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K)
    # The whole-K weight tile [BLOCK_N, K] and the bias are read before the wait (see _ln_linear_kernel).
    w = tl.load(W + rn[:, None] * K + rk[None, :], mask=(rn < N)[:, None], other=0.0)
    if HAS_BIAS:
        bias = tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)
    wait_then_trigger(PDL)
    mm = rm < M
    x = tl.load(X + rm[:, None] * K + rk[None, :], mask=mm[:, None], other=0.0)
    acc = mma(x, tl.trans(w), IEEE)
    if HAS_BIAS:
        acc += bias[None, :]
    om = mm[:, None] & (rn < N)[None, :]
    y = acc.to(Y.dtype.element_ty)
    if HAS_RES:  # the GEMM output rounded, then the residual add rounded: F.linear followed by torch.add
        y = (y.to(tl.float32) + tl.load(RES + rm[:, None] * N + rn[None, :], mask=om, other=0.0).to(tl.float32))
        y = y.to(Y.dtype.element_ty)
    tl.store(Y + rm[:, None] * N + rn[None, :], y, mask=om)


# The streaming sizes `linear` takes: up to this many rows (2 sessions' CFG windows; at 4 sessions cuBLAS was faster,
# solve 18.1 vs 18.9 ms on an H200, at 1 this kernel: 15.9 -> 12.3 ms), and K a power of two up to LINEAR_MAX_K (one
# whole-K tile per program, BLOCK_N x K <= LINEAR_TILE elements held in registers).
LINEAR_MAX_ROWS = 160
LINEAR_MAX_K = 1024


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual, shaped as the output) for x [..., K]. At streaming sizes on CUDA one
    kernel whose programs hold a whole-K weight tile, read before the programmatic-launch wait, so the weight's HBM
    latency overlaps the kernel before; other sizes (and CPU) go to F.linear."""
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if not (x.is_cuda and 0 < m <= LINEAR_MAX_ROWS and 16 <= k <= LINEAR_MAX_K and k & (k - 1) == 0
            and weight.shape[1] == k and weight.stride(1) == 1 and weight.stride(0) == k
            and x.dtype == weight.dtype):
        y = F.linear(x, weight, bias)
        return y if residual is None else y + residual
    x2 = x.reshape(m, k)
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    if residual is not None:
        if residual.shape != y.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match the output {tuple(y.shape)}")
        residual = residual if residual.is_contiguous() else residual.contiguous()
    tiles = STREAM_TILES
    bm, bn = tiles.linear_m, max(16, min(64, tiles.linear_tile // k))
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, weight, bias if bias is not None else weight, residual if residual is not None else y, y, m, n, K=k,
        BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        IEEE=x.dtype == torch.float32, num_warps=tiles.linear_warps, num_stages=1, **launch_for(x.device, m))
    return y
