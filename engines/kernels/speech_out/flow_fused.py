"""Triton fusions for the codec's CFM estimator (GPU only; engines/speech_out/flow/estimator.py dispatches).

The estimator runs ~1300 tiny kernels per call at streaming batch sizes, so launch latency dominates. These fuse
the elementwise tails around its LayerNorms. Rounding order follows the torch path (float32 math, rounded to the
activation dtype wherever the torch path stores a tensor), so GPU and CPU agree to bf16 rounding:
- `layernorm_mish`: LayerNorm over the channels of a [B, C, T] tensor (+ affine) -> Mish -> + row [B|1, C]
  -> + residual [B, C, T]; replaces transpose/LayerNorm/transpose/Mish/add/add.
- `add_layernorm`: s = x + r (the residual stream, stored), y = LayerNorm(s); replaces add + LayerNorm.
- `causal_conv`: a causal Conv1d (kernel K, left context K - 1) as one implicit GEMM over the K shifted input rows,
  bias in the epilogue; replaces cuDNN's layout transform -> conv -> transform back (3 kernels, ~14 us at
  batch 1, for a ~6 us conv). At streaming row counts the whole (tap, channel) reduction is one tile.
- `ln_linear`: add + LayerNorm as the prologue of the GEMM after it (+ bias, + GELU).
- `linear`: the to_out and ff output GEMMs at streaming row counts (one whole-K weight tile per program; + the
  residual stream in the epilogue for the last block of a stack).
- `window_attention`: softmax attention of the short estimator window, one program per (row, head).
- `ln_qkv_attention`: `ln_linear`'s q/k/v GEMM and `window_attention` as one program per (row, head), where a solve
  has the windows for its few, larger programs to be faster (`QKV_ATTENTION_ROWS`).

Strides are specialized (Triton compiles a variant per stride divisible by 16 or not): the estimator's are, so
the row loads of the convs and the window attention are vectorized. Unspecialized batch and time strides (before
2026-11-24) cost the solve graph ~9% at every batch on an H200 (batch 1 10.84 -> 9.94 ms, 32 sessions 31.6 -> 28.6),
bit-identical output. Row counts (M, T) stay unspecialized.

At streaming sizes (<= PDL_MAX_ROWS rows) the kernels launch with programmatic dependent launch
(engines/kernels/pdl.py): each reads its weights, which nothing in a solve writes, before waiting for the kernel
before it, so the weights' HBM latency and the launch overlap that kernel's tail.
The estimator keeps its [B, C, T] activations in time-major memory ([B, T, C] dense, strides (T*C, 1, C)), the layout
the transformer blocks and these kernels read without copies. Inputs may be strided (a transposed view): no
.contiguous() copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engines.kernels.pdl import launch_kwargs, trigger_then_wait, wait_then_trigger

# Elements of the weight tile one program of the whole-tile kernels (`linear`, the streaming conv) holds in
# registers: 32 KB of bf16 over 4 warps.
LINEAR_TILE = 16384

# Programmatic dependent launch (engines/kernels/pdl.py) for calls of up to this many rows (4 sessions' CFG windows).
# Solve graph on an H200 (`python3 -m engines.profiling.profile_codec --timeline`): batch 1 16.3 -> 15.9 ms with PDL
# alone, batch 4 18.5 -> 18.1, but batch 16 23.9 -> 25.3 ms, so larger calls launch plainly.
PDL_MAX_ROWS = 320


@dataclass(frozen=True)
class StreamTiles:
    """Tilings of the whole-tile kernels at streaming row counts (`linear` and the conv up to their row limits,
    `ln_linear` up to 128 rows, `window_attention`). A development knob: `python3 -m engines.profiling.profile_codec
    --tiles` times the solve graph per variant, since a kernel timed alone favours more programs than a chain of
    kernels under PDL does."""

    ln_linear: tuple[int, int, int] = (16, 64, 4)  # BLOCK_M, BLOCK_N, warps
    linear_m: int = 16  # BLOCK_M of `linear`; BLOCK_N = linear_tile // K (16..64)
    linear_tile: int = LINEAR_TILE
    linear_warps: int = 4
    conv_m: int = 16  # BLOCK_M of the whole-tile conv; BLOCK_N = conv_tile // (taps x channels) (16..64)
    conv_tile: int = LINEAR_TILE
    attention_warps: int = 4

    def __post_init__(self) -> None:
        for name, v in (("ln_linear", self.ln_linear[:2]), ("linear_m", (self.linear_m,)), ("conv_m", (self.conv_m,))):
            if any(x < 16 or x & (x - 1) for x in v):
                raise ValueError(f"StreamTiles.{name} must be powers of two >= 16, got {v}")


STREAM_TILES = StreamTiles()


def _launch(device: torch.device, rows: int) -> dict:
    """Launch keyword arguments of a codec kernel over `rows` rows: PDL where it measured faster."""
    return launch_kwargs(device, allowed=rows <= PDL_MAX_ROWS)


@triton.jit
def _mish_f32(y):
    # mish(y) = y * tanh(softplus(y)); softplus = y above 20, exp(y) below -15 (where log(1 + e) would lose it).
    ey = tl.exp(tl.minimum(y, 20.0))
    sp = tl.where(y > 20.0, y, tl.where(y < -15.0, ey, tl.log(1.0 + ey)))
    e = tl.exp(-2.0 * sp)
    return y * (1.0 - e) / (1.0 + e)


# Rows (flattened (b, t) columns of C channels) per program of the two LayerNorm kernels, by call size: one a program
# up to NORM_ONE_ROW_MAX rows, NORM_ROWS over NORM_WARPS warps above. Alone (H100, `docs/bench/codec-norm-rows-s39.txt`)
# add_layernorm at 2,560 / 5,120 rows took 3.28 / 4.86 us one row a program and 2.67 / 3.27 with 8 over 4 warps (at 640
# rows 1.85 against 2.10), but in the solve graph 8 rows a program measured 18.56 -> 18.94 ms at 8 sessions, level at
# 32 (27.48 -> 27.42) and 41.09 -> 39.54 at 64 (5,120 rows): so only the largest rounds take it.
NORM_ONE_ROW_MAX = 2560
NORM_ROWS = 8
NORM_WARPS = 4


def _norm_launch(device: torch.device, rows: int) -> tuple[int, dict]:
    """(rows per program, launch keyword arguments) of the LayerNorm kernels over `rows` rows."""
    if rows <= NORM_ONE_ROW_MAX:
        return 1, {"num_warps": 2, **_launch(device, rows)}
    return NORM_ROWS, {"num_warps": NORM_WARPS, **_launch(device, rows)}


@triton.jit
def _norm_rows(M, T, C: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ROWS flattened (b, t) rows: (row, b, t, channel offsets, [ROWS, BLOCK] mask)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    return r, r // T, r % T, offs, (r < M)[:, None] & (offs < C)[None, :]


@triton.jit
def _layernorm_f32(x, m, w, bb, eps, C: tl.constexpr):
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
    y = _layernorm_f32(x, m, w, bb, eps, C).to(dt).to(tl.float32)  # LayerNorm output is stored rounded
    y = _mish_f32(y).to(dt).to(tl.float32)
    if HAS_ROW:
        y = (y + tl.load(ROW + (b * srb)[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)).to(dt)
        y = y.to(tl.float32)
    if HAS_RES:
        y = y + tl.load(RES + (b * srsb + t * srst)[:, None] + (offs * srsc)[None, :], mask=m, other=0.0).to(
            tl.float32)
    tl.store(OUT + r[:, None] * C + offs[None, :], y.to(dt), mask=m)


def time_major(nb: int, c: int, t: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [B, C, T] tensor in time-major memory (a transposed view of a dense [B, T, C])."""
    return torch.empty(nb, t, c, device=like.device, dtype=like.dtype).transpose(1, 2)


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
    tl.store(Y + out, _layernorm_f32(x, m, w, bb, eps, C).to(dt), mask=m)


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


@triton.jit
def mma(a, b, IEEE: tl.constexpr):
    """a @ b in float32 (IEEE products for float32 operands, like the CPU reference)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


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
# K 3; docs/bench/conv-flat-s39.txt), the per-tap loop at 32 x 128 against the flat loop's best tiling: 2,560 rows
# 18.8 / 23.5 / 10.5 -> 9.6 / 12.5 / 6.3 us, 5,120 rows 33.9 / 44.9 / 13.6 -> 13.5 / 18.8 / 7.9; this tiling was within
# 0.5 us of the best wherever timed (640-5,120 rows). Solve graph at 32 sessions 28.71 -> 27.42 ms (BENCHMARKS.md).
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
            FLAT=tiling.flat, num_warps=tiling.warps, num_stages=tiling.stages, **_launch(x.device, m))
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
        num_warps=8 if cin_p * ks_p * bn > LINEAR_TILE else 4, num_stages=1, **_launch(x.device, m))
    return out


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
    h = _layernorm_f32(x, (rc < C)[None, :], lnw, lnb, eps, C).to(dt)  # LayerNorm output, stored rounded by torch
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
                                **_launch(x.device, nb * t))
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
        IEEE=x.dtype == torch.float32, num_warps=tiles.linear_warps, num_stages=1, **_launch(x.device, m))
    return y


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
        IEEE=qkv.dtype == torch.float32, num_warps=STREAM_TILES.attention_warps, **_launch(qkv.device, nb * t))
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
    hn = _layernorm_f32(x, (rc < C)[None, :], lnw, lnb, eps, C).to(dt)  # [BLOCK_T, C]
    q = mma(hn, wq, IEEE).to(dt)  # [BLOCK_T, D], rounded where ln_linear stores qkv
    k = mma(hn, wk, IEEE).to(dt)
    v = mma(hn, wv, IEEE).to(dt)
    o = _window_softmax_pv(q, k, v, MASK + b * s_mb, s_mt, rt, tm, scale, IEEE)
    tl.store(OUT + (b * T + rt)[:, None] * K + h * D + rd[None, :], o.to(dt), mask=tm[:, None])


# Windows (CFG rows: two a session) of a solve for which `ln_qkv_attention` takes a block's first two kernels: counted
# over the chains a solve runs side by side (flow.CHAIN_WINDOWS), since a call's few programs leave the SMs to the
# other chains. A program holds one head's [C, 3 x D] weights (96 KB at the estimator's shapes) and redoes the row's
# LayerNorm, so at 2-4 windows its few programs are slower than the two kernels' many, and past 16 (128 programs in
# one call) they no longer fit the SMs in one wave. Solve graph, H100, same process (docs/PERF_NOTES.md, session
# 45), graphs of 1 / 2 / 3 / 4 / 8 / 16 sessions: 9.59 -> 10.72 / 11.70 -> 11.99 / 14.93 -> 14.31 / 14.94 -> 14.32 /
# 18.49 -> 18.20 / 21.50 -> 24.41 ms (2-4 sessions as chains of 2 windows); bit-identical mels.
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
        num_stages=1, **_launch(x.device, nb * t))
    return out, s
