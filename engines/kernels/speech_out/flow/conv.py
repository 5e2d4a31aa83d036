"""`causal_conv`: a causal Conv1d (kernel K, left context K - 1) of the codec estimator as one implicit GEMM over the K
shifted input rows, bias in the epilogue; replaces cuDNN's layout transform -> conv -> transform back (3 kernels,
~14 us at batch 1, for a ~6 us conv). At streaming row counts the whole (tap, channel) reduction is one tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engines.kernels.pdl import wait_then_trigger
from engines.kernels.speech_out.flow.common import LINEAR_TILE, STREAM_TILES, launch_for, mma, time_major


@triton.jit
def _conv_k_tile(acc, X, WT, b, t, rm, rn, rk, tap, c0, M, sxb, sxt, sxc, COUT, CIN: tl.constexpr, KS: tl.constexpr,
                 IEEE: tl.constexpr):
    """acc + the products of one K tile of a causal conv: input channels c0 + rk of tap `tap`."""
    src_t = t - (KS - 1) + tap  # left context only: rows before the start read as zeros
    a = tl.load(X + (b * sxb + src_t * sxt)[:, None] + ((c0 + rk) * sxc)[None, :],
                mask=((rm < M) & (src_t >= 0))[:, None] & ((c0 + rk) < CIN)[None, :], other=0.0)
    w = tl.load(WT + ((tap * CIN + c0 + rk) * COUT)[:, None] + rn[None, :],
                mask=((c0 + rk) < CIN)[:, None] & (rn < COUT)[None, :], other=0.0)
    acc += mma(a, w, IEEE)
    return acc


@triton.jit(do_not_specialize=["M", "T"])
def _causal_conv_kernel(X, WT, BIAS, OUT, M, T, sxb, sxt, sxc, COUT, CIN: tl.constexpr, KS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                        PDL: tl.constexpr, FLAT: tl.constexpr = False):
    """A K loop per tap, or with FLAT (BLOCK_K dividing CIN) one loop over the flattened (tap, channel) reduction, so
    the loads' pipeline does not start again at each tap (served from CONV_FLAT_MIN_ROWS rows). The same K tiles in
    the same order either way."""
    wait_then_trigger(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (b, t) output rows
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    b = rm // T
    t = rm % T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FLAT:
        for k0 in range(0, KS * CIN, BLOCK_K):
            tap = k0 // CIN
            acc = _conv_k_tile(acc, X, WT, b, t, rm, rn, rk, tap, k0 - tap * CIN, M, sxb, sxt, sxc, COUT, CIN, KS,
                               IEEE)
    else:
        for tap in tl.static_range(KS):
            for c0 in range(0, CIN, BLOCK_K):
                acc = _conv_k_tile(acc, X, WT, b, t, rm, rn, rk, tap, c0, M, sxb, sxt, sxc, COUT, CIN, KS, IEEE)
    acc += tl.load(BIAS + rn, mask=rn < COUT, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None] * COUT + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < COUT)[None, :])


@triton.jit(do_not_specialize=["M", "T"])
def _conv_whole_kernel(X, WT, BIAS, OUT, M, T, sxb, sxt, sxc, COUT, CIN: tl.constexpr, KS: tl.constexpr,
                       CIN_P: tl.constexpr, KS_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IEEE: tl.constexpr, PDL: tl.constexpr):
    """_causal_conv_kernel for streaming row counts: the reduction over (tap, channel) is one tile, so a program
    holds its whole weight slice, read before the programmatic-launch wait, and runs one dot."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, KS_P * CIN_P)  # flattened (tap, channel) reduction axis, padded to powers of two
    tap = rr // CIN_P
    c = rr % CIN_P
    r_ok = (tap < KS) & (c < CIN)
    w = tl.load(WT + ((tap * CIN + c) * COUT)[:, None] + rn[None, :], mask=r_ok[:, None] & (rn < COUT)[None, :],
                other=0.0)
    bias = tl.load(BIAS + rn, mask=rn < COUT, other=0.0).to(tl.float32)
    wait_then_trigger(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (b, t) output rows
    b = rm // T
    src_t = (rm % T)[:, None] - (KS - 1) + tap[None, :]  # left context only: rows before the start read as zeros
    am = (rm < M)[:, None] & r_ok[None, :] & (src_t >= 0)
    a = tl.load(X + (b * sxb)[:, None] + src_t * sxt + (c * sxc)[None, :], mask=am, other=0.0)
    acc = mma(a, w, IEEE)
    acc += bias[None, :]
    tl.store(OUT + rm[:, None] * COUT + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < COUT)[None, :])


# Up to this many output rows (two sessions' CFG windows) a conv runs as _conv_whole_kernel, while its (tap, channel)
# row of the weight stays under CONV_WHOLE_MAX_BYTES (2048 bf16 or 1024 float32 values: the A and W tiles then fit
# shared memory). Solve graph, H200, PDL on: batch 1 12.3 -> 11.2 ms, batch 2 14.7 -> 14.1, batch 4 no change.
CONV_WHOLE_MAX_ROWS = 160
CONV_WHOLE_MAX_BYTES = 4096


@dataclass(frozen=True)
class ConvTiling:
    """One launch configuration of _causal_conv_kernel."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 2
    flat: bool = False  # one pipelined loop over the flattened (tap, channel) reduction; block_k must divide Cin


# From this many output rows (eight sessions' CFG windows in a playing round), 2-byte inputs whose channels BLOCK_K
# divides run the FLAT loop with wgmma-sized tiles. The per-tap loop restarts its 2-stage pipeline at each of the 3
# taps (2-4 K tiles each) and its 32-row tiles run mma.sync. A tile sweep on an H100 (bf16, Cin 320 / 512 / 256,
# K 3; 2026-11-27), the per-tap loop at 32 x 128 against the flat loop's best tiling: 2,560 rows
# 18.8 / 23.5 / 10.5 -> 9.6 / 12.5 / 6.3 us, 5,120 rows 33.9 / 44.9 / 13.6 -> 13.5 / 18.8 / 7.9; this tiling was within
# 0.5 us of the best wherever timed (640-5,120 rows). Solve graph at 32 sessions 28.71 -> 27.42 ms.
CONV_FLAT_MIN_ROWS = 640
CONV_FLAT_TILING = ConvTiling(64, 128, 64, warps=4, stages=3, flat=True)


def conv_block_k(cin: int) -> int:
    """BLOCK_K of the per-tap loop: the input channels' power of two, 16 to 128."""
    return max(16, min(128, triton.next_power_of_2(cin)))


def _conv_tiling(rows: int, cin: int, element_size: int) -> ConvTiling:
    """_causal_conv_kernel's tiling by output rows: small tiles (more programs, short K loops) for streaming batches,
    the flat loop for playing rounds. From a tile sweep on an H200 (bf16, Cin 256-512, K 3):
    80 rows 5.3-8.3 us, 320 rows 5.9-9.3 us, where cuDNN's conv1d takes 16-22 us plus two layout transforms."""
    bk = conv_block_k(cin)
    flat = CONV_FLAT_TILING
    if rows >= CONV_FLAT_MIN_ROWS and element_size == 2 and cin % flat.block_k == 0:
        return flat
    if rows <= 128:
        return ConvTiling(16, 32, bk)
    if rows <= 512:
        return ConvTiling(16, 64, bk)
    return ConvTiling(32, 128, bk)


def launch_causal_conv(x: torch.Tensor, w_gemm: torch.Tensor, bias: torch.Tensor, kernel: int, tiling: ConvTiling
                       ) -> torch.Tensor:
    """causal_conv through _causal_conv_kernel with the given tiling (the GPU tests run other tilings through it)."""
    nb, cin, t = x.shape
    cout = w_gemm.shape[1]
    if tiling.flat and cin % tiling.block_k:
        raise ValueError(f"the flat conv loop needs BLOCK_K ({tiling.block_k}) to divide the {cin} input channels")
    out = time_major(nb, cout, t, x)
    m = nb * t
    if m:
        _causal_conv_kernel[(triton.cdiv(m, tiling.block_m), triton.cdiv(cout, tiling.block_n))](
            x, w_gemm, bias, out, m, t, x.stride(0), x.stride(2), x.stride(1), cout, CIN=cin, KS=kernel,
            BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, IEEE=x.dtype == torch.float32,
            FLAT=tiling.flat, num_warps=tiling.warps, num_stages=tiling.stages, **launch_for(x.device, m))
    return out


def causal_conv(x: torch.Tensor, w_gemm: torch.Tensor, bias: torch.Tensor, kernel: int) -> torch.Tensor:
    """x [B, Cin, T] (any strides), w_gemm [kernel * Cin, Cout] (estimator.conv_weight_gemm) -> causal conv
    [B, Cout, T] time-major: out[:, :, t] = bias + sum_tap W[:, :, tap] @ x[:, :, t - (kernel - 1) + tap] (zeros
    before t = 0), accumulated in float32. float32 inputs use IEEE products (no TF32), like the CPU reference."""
    nb, cin, t = x.shape
    cout = w_gemm.shape[1]
    if w_gemm.shape[0] != kernel * cin:
        raise ValueError(f"conv weight {tuple(w_gemm.shape)} does not fit {cin} channels x kernel {kernel}")
    m = nb * t
    cin_p, ks_p = max(16, triton.next_power_of_2(cin)), triton.next_power_of_2(kernel)
    if not (0 < m <= CONV_WHOLE_MAX_ROWS and cin_p * ks_p * x.element_size() <= CONV_WHOLE_MAX_BYTES):
        return launch_causal_conv(x, w_gemm, bias, kernel, _conv_tiling(m, cin, x.element_size()))
    out = time_major(nb, cout, t, x)
    tiles = STREAM_TILES
    bn = max(16, min(64, tiles.conv_tile // (cin_p * ks_p)))
    _conv_whole_kernel[(triton.cdiv(m, tiles.conv_m), triton.cdiv(cout, bn))](
        x, w_gemm, bias, out, m, t, x.stride(0), x.stride(2), x.stride(1), cout, CIN=cin, KS=kernel, CIN_P=cin_p,
        KS_P=ks_p, BLOCK_M=tiles.conv_m, BLOCK_N=bn, IEEE=x.dtype == torch.float32,
        num_warps=8 if cin_p * ks_p * bn > LINEAR_TILE else 4, num_stages=1, **launch_for(x.device, m))
    return out
