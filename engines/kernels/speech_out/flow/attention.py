"""Attention of the codec estimator's short window:
- `window_attention`: softmax attention of the window, one program per (row, head).
- `ln_qkv_attention`: `ln_linear`'s q/k/v GEMM and `window_attention` as one program per (row, head), where a solve
  has the windows for its few, larger programs to be faster (`QKV_ATTENTION_ROWS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.pdl import wait_then_trigger
from engines.kernels.speech_out.flow.common import STREAM_TILES, launch_for, mma
from engines.kernels.speech_out.flow.gemm import LN_LINEAR_MAX_ROWS
from engines.kernels.speech_out.flow.norms import layernorm_f32


@triton.jit
def softmax_pv(sc, v, IEEE: tl.constexpr):
    """softmax(sc) @ v for float32 scores sc [Tq, Tk] (masked entries -inf) and v [Tk, D] -> float32 [Tq, D]. A
    fully masked (padding) row gives zeros, not NaN."""
    mx = tl.max(sc, 1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    p = tl.exp(sc - mx[:, None])
    den = tl.sum(p, 1)
    p = p / tl.where(den == 0.0, 1.0, den)[:, None]
    if IEEE:
        return tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


@triton.jit
def _window_softmax_pv(q, k, v, MASK, s_mt, rt, tm, scale, IEEE: tl.constexpr):
    """softmax(q k^T * scale + mask) v of one window's head: q, k, v [BLOCK_T, D] (rows past the window's T masked by
    tm), MASK the window's additive [T, T] mask (rows s_mt apart) -> float32 [BLOCK_T, D]."""
    am = tl.load(MASK + rt[:, None] * s_mt + rt[None, :], mask=tm[:, None] & tm[None, :],
                 other=float("-inf")).to(tl.float32)
    return softmax_pv(mma(q, tl.trans(k), IEEE) * scale + am, v, IEEE)


@triton.jit(do_not_specialize=["T"])
def _window_attention_kernel(QKV, MASK, OUT, T, s_qkv_b, s_qkv_t, s_mb, s_mt, s_ob, s_ot, scale,
                             H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
                             PDL: tl.constexpr):
    wait_then_trigger(PDL)
    pid = tl.program_id(0)  # one (batch row, head)
    b = pid // H
    h = pid % H
    rt = tl.arange(0, BLOCK_T)
    rd = tl.arange(0, D)
    tm = rt < T
    base = QKV + b * s_qkv_b + h * D
    q = tl.load(base + rt[:, None] * s_qkv_t + rd[None, :], mask=tm[:, None], other=0.0)
    k = tl.load(base + H * D + rt[:, None] * s_qkv_t + rd[None, :], mask=tm[:, None], other=0.0)
    v = tl.load(base + 2 * H * D + rt[:, None] * s_qkv_t + rd[None, :], mask=tm[:, None], other=0.0)
    o = _window_softmax_pv(q, k, v, MASK + b * s_mb, s_mt, rt, tm, scale, IEEE)
    tl.store(OUT + b * s_ob + rt[:, None] * s_ot + h * D + rd[None, :], o.to(OUT.dtype.element_ty),
             mask=tm[:, None])


WINDOW_ATTENTION_MAX_T = 128  # one tile of queries and keys per (row, head); longer windows use SDPA


def window_attention(qkv: torch.Tensor, mask: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Softmax attention of a short window in one kernel per call: qkv [B, T, 3 * heads * head_dim] (q | k | v, each
    head-major), mask additive [T, T] or [B, T, T] (0 / -inf, any float dtype) -> [B, T, heads * head_dim].
    T <= WINDOW_ATTENTION_MAX_T."""
    nb, t, three_hd = qkv.shape
    if three_hd != 3 * heads * head_dim or qkv.stride(2) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [B, T, 3 x {heads} x {head_dim}] with dense rows")
    if t > WINDOW_ATTENTION_MAX_T:
        raise ValueError(f"window of {t} frames exceeds {WINDOW_ATTENTION_MAX_T}")
    if mask.stride(-1) != 1:
        raise ValueError("mask rows must be dense")
    out = torch.empty(nb, t, heads * head_dim, device=qkv.device, dtype=qkv.dtype)
    s_mb = mask.stride(0) if mask.dim() == 3 else 0
    _window_attention_kernel[(nb * heads,)](
        qkv, mask, out, t, qkv.stride(0), qkv.stride(1), s_mb, mask.stride(-2), out.stride(0), out.stride(1),
        head_dim ** -0.5, H=heads, D=head_dim, BLOCK_T=max(16, triton.next_power_of_2(t)),
        IEEE=qkv.dtype == torch.float32, num_warps=STREAM_TILES.attention_warps, **launch_for(qkv.device, nb * t))
    return out


@triton.jit(do_not_specialize=["T"])
def _ln_qkv_attention_kernel(X, R, LNW, LNB, WT, MASK, S, OUT, T, s_mb, s_mt, eps, scale, C: tl.constexpr,
                             H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_RES: tl.constexpr,
                             IEEE: tl.constexpr, PDL: tl.constexpr):
    """_ln_linear_kernel's q/k/v GEMM and _window_attention_kernel as one program per (row, head): the head's q, k, v
    columns of the GEMM are all its attention reads, so nothing is recomputed but the row's LayerNorm (once a head),
    and q/k/v never go through memory. Same rounding points as the two kernels."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    K: tl.constexpr = H * D
    rc = tl.arange(0, C)
    rd = tl.arange(0, D)
    rt = tl.arange(0, BLOCK_T)
    tm = rt < T
    dt = OUT.dtype.element_ty
    lnw = tl.load(LNW + rc).to(tl.float32)
    lnb = tl.load(LNB + rc).to(tl.float32)
    wcol = WT + rc[:, None] * (3 * K) + h * D + rd[None, :]  # [C, D]: head h's q columns (its k, v: K, 2K on)
    wq = tl.load(wcol)  # weights before the wait, as in _ln_linear_kernel
    wk = tl.load(wcol + K)
    wv = tl.load(wcol + 2 * K)
    wait_then_trigger(PDL)
    rows = (b * T + rt)[:, None] * C + rc[None, :]
    x = tl.load(X + rows, mask=tm[:, None], other=0.0).to(tl.float32)
    if HAS_RES:
        x = (x + tl.load(R + rows, mask=tm[:, None], other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        if h == 0:  # one head's programs store the residual stream
            tl.store(S + rows, x.to(dt), mask=tm[:, None])
    hn = layernorm_f32(x, (rc < C)[None, :], lnw, lnb, eps, C).to(dt)  # [BLOCK_T, C]
    q = mma(hn, wq, IEEE).to(dt)  # [BLOCK_T, D], rounded where ln_linear stores qkv
    k = mma(hn, wk, IEEE).to(dt)
    v = mma(hn, wv, IEEE).to(dt)
    o = _window_softmax_pv(q, k, v, MASK + b * s_mb, s_mt, rt, tm, scale, IEEE)
    tl.store(OUT + (b * T + rt)[:, None] * K + h * D + rd[None, :], o.to(dt), mask=tm[:, None])


# Windows (CFG rows: two a session) of a solve for which `ln_qkv_attention` takes a block's first two kernels: counted
# over the chains a solve runs side by side (engines/speech_out/flow/flow.py CHAIN_WINDOWS), since a call's few programs
# leave the SMs to the other chains. A program holds one head's [C, 3 x D] weights (96 KB at the estimator's shapes) and
# redoes the row's LayerNorm, so at 2-4 windows its few programs are slower than the two kernels' many, and past 16 (128
# programs in one call) they no longer fit the SMs in one wave. Solve graph, H100, same process (2026-11-28), graphs of
# 1 / 2 / 3 / 4 / 8 / 16 sessions: 9.59 -> 10.72 / 11.70 -> 11.99 / 14.93 -> 14.31 / 14.94 -> 14.32 / 18.49 -> 18.20 /
# 21.50 -> 24.41 ms (2-4 sessions as chains of 2 windows); bit-identical mels.
QKV_ATTENTION_ROWS = (6, 16)
QKV_ATTENTION_MAX_T = 64
QKV_ATTENTION_MAX_WEIGHT_BYTES = 98304  # a program's three weight tiles (shared memory)


def _ln_qkv_attention_takes(x: torch.Tensor, head_dim: int) -> bool:
    """x [B, T, C] the kernel can run: 2-byte activations, short windows, a weight slice that fits shared memory, and
    no more rows than ln_linear's own kernel takes (so the result is the two kernels' bit for bit)."""
    nb, t, c = x.shape
    return (x.is_cuda and x.element_size() == 2 and 0 < nb and 0 < t <= QKV_ATTENTION_MAX_T
            and nb * t <= LN_LINEAR_MAX_ROWS and c & (c - 1) == 0 and head_dim & (head_dim - 1) == 0
            and 16 <= head_dim and 16 <= c and 3 * c * head_dim * x.element_size() <= QKV_ATTENTION_MAX_WEIGHT_BYTES)


def ln_qkv_attention_fits(x: torch.Tensor, head_dim: int, windows: int | None = None) -> bool:
    """Whether `ln_qkv_attention` serves a block's input x [B, T, C]: the kernel takes it and `windows` (the rows of
    every call side by side with this one; default B) are in QKV_ATTENTION_ROWS, B within its top."""
    lo, hi = QKV_ATTENTION_ROWS
    return lo <= (windows or x.shape[0]) <= hi and x.shape[0] <= hi and _ln_qkv_attention_takes(x, head_dim)


def ln_qkv_attention(x: torch.Tensor, residual: torch.Tensor | None, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                     eps: float, w_t: torch.Tensor, mask: torch.Tensor, heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """window_attention(ln_linear(x, residual, ln_weight, ln_bias, eps, w_t)[0], mask, heads, head_dim) in one
    kernel, bit for bit (faster where `ln_qkv_attention_fits`): returns (attention output [B, T, heads * head_dim],
    the residual stream s = x + residual [B, T, C], x itself when residual is None). w_t [C, 3 * heads * head_dim]."""
    nb, t, c = x.shape
    if not _ln_qkv_attention_takes(x, head_dim):
        raise ValueError(f"ln_qkv_attention does not take x {tuple(x.shape)} {x.dtype} with {heads} heads of "
                         f"{head_dim}: 2-byte activations, windows of <= {QKV_ATTENTION_MAX_T} frames, <= "
                         f"{LN_LINEAR_MAX_ROWS} rows, power-of-two widths, <= {QKV_ATTENTION_MAX_WEIGHT_BYTES} "
                         "weight bytes a head")
    if tuple(w_t.shape) != (c, 3 * heads * head_dim) or w_t.stride(1) != 1 or w_t.stride(0) != w_t.shape[1]:
        raise ValueError(f"q/k/v weight {tuple(w_t.shape)} is not a dense [{c}, 3 x {heads} x {head_dim}]")
    if tuple(mask.shape[-2:]) != (t, t) or mask.stride(-1) != 1:
        raise ValueError(f"mask {tuple(mask.shape)} is not [({nb},) {t}, {t}] with dense rows")
    x = x if x.is_contiguous() else x.contiguous()
    s = x
    if residual is not None:
        residual = residual if residual.is_contiguous() else residual.contiguous()
        s = torch.empty_like(x)
    out = torch.empty(nb, t, heads * head_dim, device=x.device, dtype=x.dtype)
    _ln_qkv_attention_kernel[(nb, heads)](
        x, residual if residual is not None else x, ln_weight, ln_bias, w_t, mask, s, out, t,
        mask.stride(0) if mask.dim() == 3 else 0, mask.stride(-2), eps, head_dim ** -0.5, C=c, H=heads, D=head_dim,
        BLOCK_T=max(16, triton.next_power_of_2(t)), HAS_RES=residual is not None, IEEE=False, num_warps=8,
        num_stages=1, **launch_for(x.device, nb * t))
    return out, s
