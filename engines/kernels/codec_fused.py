"""Triton fusions for the codec's CFM estimator (GPU only; engines/codec/decoder/estimator.py dispatches).

The estimator runs ~1300 tiny kernels per call at streaming batch sizes, so launch latency dominates. These fuse
the elementwise tails around its LayerNorms. Rounding order follows the torch path (float32 math, rounded to the
activation dtype wherever the torch path stores a tensor), so GPU and CPU agree to bf16 rounding:
- `layernorm_mish`: LayerNorm over the channels of a [B, C, T] tensor (+ affine) -> Mish -> + row [B|1, C]
  -> + residual [B, C, T]; replaces transpose/LayerNorm/transpose/Mish/add/add.
- `add_layernorm`: s = x + r (the residual stream, stored), y = LayerNorm(s); replaces add + LayerNorm.
Inputs may be strided (a sliced causal conv output, a transposed view): no .contiguous() copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mish_f32(y):
    # mish(y) = y * tanh(softplus(y)); softplus = y above 20, exp(y) below -15 (where log(1 + e) would lose it).
    ey = tl.exp(tl.minimum(y, 20.0))
    sp = tl.where(y > 20.0, y, tl.where(y < -15.0, ey, tl.log(1.0 + ey)))
    e = tl.exp(-2.0 * sp)
    return y * (1.0 - e) / (1.0 + e)


@triton.jit
def _layernorm_mish_kernel(X, W, B, ROW, RES, OUT, sxb, sxc, sxt, srb, srsb, srsc, srst, T, eps,
                           C: tl.constexpr, BLOCK: tl.constexpr, HAS_ROW: tl.constexpr, HAS_RES: tl.constexpr):
    pid = tl.program_id(0)  # one (b, t) column of C channels
    b = pid // T
    t = pid % T
    offs = tl.arange(0, BLOCK)
    m = offs < C
    x = tl.load(X + b * sxb + offs * sxc + t * sxt, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / C
    d = tl.where(m, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 0) / C + eps)
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    bb = tl.load(B + offs, mask=m, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    y = (d * rstd * w + bb).to(dt).to(tl.float32)  # LayerNorm output is stored rounded
    y = _mish_f32(y).to(dt).to(tl.float32)
    if HAS_ROW:
        y = (y + tl.load(ROW + b * srb + offs, mask=m, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    if HAS_RES:
        y = y + tl.load(RES + b * srsb + offs * srsc + t * srst, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + b * C * T + offs * T + t, y.to(dt), mask=m)


def layernorm_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   row: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T] (any strides) -> mish(LayerNorm over C) (+ row[:, :, None]) (+ residual), [B, C, T] contiguous.
    row: [B, C] or [1, C]; residual: [B, C, T] (any strides)."""
    nb, c, t = x.shape
    out = torch.empty(nb, c, t, device=x.device, dtype=x.dtype)
    if nb * t:
        r = row if row is not None else x
        rs = residual if residual is not None else x
        srb = row.stride(0) if row is not None and row.shape[0] > 1 else 0
        _layernorm_mish_kernel[(nb * t,)](
            x, weight, bias, r, rs, out, x.stride(0), x.stride(1), x.stride(2), srb, rs.stride(0), rs.stride(1),
            rs.stride(2), t, eps, C=c, BLOCK=triton.next_power_of_2(c), HAS_ROW=row is not None,
            HAS_RES=residual is not None, num_warps=2)
    return out


@triton.jit
def _add_layernorm_kernel(X, R, W, B, Y, S, sxb, sxt, sxc, srb, srt, src, T, eps, C: tl.constexpr,
                          BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    pid = tl.program_id(0)  # one (b, t) row of C channels
    b = pid // T
    t = pid % T
    offs = tl.arange(0, BLOCK)
    m = offs < C
    dt = Y.dtype.element_ty
    x = tl.load(X + b * sxb + t * sxt + offs * sxc, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = (x + tl.load(R + b * srb + t * srt + offs * src, mask=m, other=0.0).to(tl.float32)).to(dt)
        x = x.to(tl.float32)
    tl.store(S + pid * C + offs, x.to(dt), mask=m)
    mean = tl.sum(x, 0) / C
    d = tl.where(m, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 0) / C + eps)
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    bb = tl.load(B + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + pid * C + offs, (d * rstd * w + bb).to(dt), mask=m)


def add_layernorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [B, T, C] (any strides) -> (LayerNorm(x + residual), x + residual), both [B, T, C] contiguous."""
    nb, t, c = x.shape
    y = torch.empty(nb, t, c, device=x.device, dtype=x.dtype)
    s = torch.empty_like(y)
    if nb * t:
        r = residual if residual is not None else x
        _add_layernorm_kernel[(nb * t,)](
            x, r, weight, bias, y, s, x.stride(0), x.stride(1), x.stride(2), r.stride(0), r.stride(1), r.stride(2),
            t, eps, C=c, BLOCK=triton.next_power_of_2(c), HAS_RES=residual is not None, num_warps=2)
    return y, s
