"""LayerNorm tails of the codec estimator:
- `layernorm_mish`: LayerNorm over the channels of a [B, C, T] tensor (+ affine) -> Mish -> + row [B|1, C]
  -> + residual [B, C, T]; replaces transpose/LayerNorm/transpose/Mish/add/add.
- `add_layernorm`: s = x + r (the residual stream, stored), y = LayerNorm(s); replaces add + LayerNorm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.pdl import trigger_then_wait
from engines.kernels.speech_out.flow.common import launch_for, time_major


@triton.jit
def _mish_f32(y):
    # mish(y) = y * tanh(softplus(y)); softplus = y above 20, exp(y) below -15 (where log(1 + e) would lose it).
    ey = tl.exp(tl.minimum(y, 20.0))
    sp = tl.where(y > 20.0, y, tl.where(y < -15.0, ey, tl.log(1.0 + ey)))
    e = tl.exp(-2.0 * sp)
    return y * (1.0 - e) / (1.0 + e)


# Rows (flattened (b, t) columns of C channels) per program of the two LayerNorm kernels, by call size: one a program up
# to NORM_ONE_ROW_MAX rows, NORM_ROWS over NORM_WARPS warps above. Alone (H100, 2026-11-27) add_layernorm at 2,560 /
# 5,120 rows took 3.28 / 4.86 us one row a program and 2.67 / 3.27 with 8 over 4 warps (at 640 rows 1.85 against 2.10),
# but in the solve graph 8 rows a program measured 18.56 -> 18.94 ms at 8 sessions, level at 32 (27.48 -> 27.42) and
# 41.09 -> 39.54 at 64 (5,120 rows): so only the largest rounds take it.
NORM_ONE_ROW_MAX = 2560
NORM_ROWS = 8
NORM_WARPS = 4


def _norm_launch(device: torch.device, rows: int) -> tuple[int, dict]:
    """(rows per program, launch keyword arguments) of the LayerNorm kernels over `rows` rows."""
    if rows <= NORM_ONE_ROW_MAX:
        return 1, {"num_warps": 2, **launch_for(device, rows)}
    return NORM_ROWS, {"num_warps": NORM_WARPS, **launch_for(device, rows)}


@triton.jit
def _norm_rows(M, T, C: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ROWS flattened (b, t) rows: (row, b, t, channel offsets, [ROWS, BLOCK] mask)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    return r, r // T, r % T, offs, (r < M)[:, None] & (offs < C)[None, :]


@triton.jit
def layernorm_f32(x, m, w, bb, eps, C: tl.constexpr):
    """LayerNorm over the channels (axis 1) of float32 rows x [ROWS, BLOCK] (masked channels ignored)."""
    mean = tl.sum(x, 1) / C
    d = tl.where(m, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / C + eps)
    return d * rstd[:, None] * w[None, :] + bb[None, :]


@triton.jit
def _layernorm_mish_kernel(X, W, B, ROW, RES, OUT, M, sxb, sxc, sxt, srb, srsb, srsc, srst, T, eps,
                           C: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_ROW: tl.constexpr,
                           HAS_RES: tl.constexpr, PDL: tl.constexpr):
    r, b, t, offs, m = _norm_rows(M, T, C, ROWS, BLOCK)
    w = tl.load(W + offs, mask=offs < C, other=0.0).to(tl.float32)  # weights: read before the wait (never written)
    bb = tl.load(B + offs, mask=offs < C, other=0.0).to(tl.float32)
    trigger_then_wait(PDL)
    x = tl.load(X + (b * sxb + t * sxt)[:, None] + (offs * sxc)[None, :], mask=m, other=0.0).to(tl.float32)
    dt = OUT.dtype.element_ty
    y = layernorm_f32(x, m, w, bb, eps, C).to(dt).to(tl.float32)  # LayerNorm output is stored rounded
    y = _mish_f32(y).to(dt).to(tl.float32)
    if HAS_ROW:
        y = (y + tl.load(ROW + (b * srb)[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)).to(dt)
        y = y.to(tl.float32)
    if HAS_RES:
        y = y + tl.load(RES + (b * srsb + t * srst)[:, None] + (offs * srsc)[None, :], mask=m, other=0.0).to(
            tl.float32)
    tl.store(OUT + r[:, None] * C + offs[None, :], y.to(dt), mask=m)



def layernorm_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   row: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T] (any strides) -> mish(LayerNorm over C) (+ row[:, :, None]) (+ residual), [B, C, T] time-major.
    row: [B, C] or [1, C]; residual: [B, C, T] (any strides)."""
    nb, c, t = x.shape
    out = time_major(nb, c, t, x)
    if nb * t:
        r = row if row is not None else x
        rs = residual if residual is not None else x
        srb = row.stride(0) if row is not None and row.shape[0] > 1 else 0
        rows, kw = _norm_launch(x.device, nb * t)
        _layernorm_mish_kernel[(triton.cdiv(nb * t, rows),)](
            x, weight, bias, r, rs, out, nb * t, x.stride(0), x.stride(1), x.stride(2), srb, rs.stride(0),
            rs.stride(1), rs.stride(2), t, eps, C=c, BLOCK=triton.next_power_of_2(c), ROWS=rows,
            HAS_ROW=row is not None, HAS_RES=residual is not None, **kw)
    return out


@triton.jit
def _add_layernorm_kernel(X, R, W, B, Y, S, M, sxb, sxt, sxc, srb, srt, src, T, eps, C: tl.constexpr,
                          BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr):
    r, b, t, offs, m = _norm_rows(M, T, C, ROWS, BLOCK)
    w = tl.load(W + offs, mask=offs < C, other=0.0).to(tl.float32)
    bb = tl.load(B + offs, mask=offs < C, other=0.0).to(tl.float32)
    trigger_then_wait(PDL)
    dt = Y.dtype.element_ty
    x = tl.load(X + (b * sxb + t * sxt)[:, None] + (offs * sxc)[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + (b * srb + t * srt)[:, None] + (offs * src)[None, :], mask=m, other=0.0).to(tl.float32)
        x = x.to(dt).to(tl.float32)
    out = r[:, None] * C + offs[None, :]
    tl.store(S + out, x.to(dt), mask=m)
    tl.store(Y + out, layernorm_f32(x, m, w, bb, eps, C).to(dt), mask=m)


def add_layernorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [B, T, C] (any strides) -> (LayerNorm(x + residual), x + residual), both [B, T, C] contiguous."""
    nb, t, c = x.shape
    y = torch.empty(nb, t, c, device=x.device, dtype=x.dtype)
    s = torch.empty_like(y)
    if nb * t:
        r = residual if residual is not None else x
        rows, kw = _norm_launch(x.device, nb * t)
        _add_layernorm_kernel[(triton.cdiv(nb * t, rows),)](
            x, r, weight, bias, y, s, nb * t, x.stride(0), x.stride(1), x.stride(2), r.stride(0), r.stride(1),
            r.stride(2), t, eps, C=c, BLOCK=triton.next_power_of_2(c), ROWS=rows, HAS_RES=residual is not None,
            **kw)
    return y, s
