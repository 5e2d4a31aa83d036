"""float32 GEMM on tensor cores at float32 accuracy (3xTF32), for the speech encoder's linear layers.

The speech encoder runs in float32 so that streamed codes equal whole-utterance codes (engines/speech_in). cuBLAS
runs float32 GEMMs on the CUDA cores (SIMT SGEMM, ~30 TFLOP/s here); plain TF32 would change features at the 1e-3
level. Triton's `tf32x3` dot splits each operand into a TF32 high part and a TF32 remainder and sums three tensor-core
products (high x high, high x low, low x high) in float32: errors of the order of float32's own rounding, at tensor-core
speed. y = x @ w.T + bias [then exact (erf) GELU], one tiling for every M, so a row's result does not depend on the
rows beside it.

`tf32=True` (the speech encoder's numerics option, `--encoder-tf32`): one TF32 product instead of three, ~3x less
tensor-core work, errors of TF32's 10-bit mantissa (~1e-3 relative); then this kernel serves every row count, so a
row's result is the same bits whatever the rows beside it (cuBLAS's TF32 below MIN_ROWS would sum in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows below which cuBLAS's SGEMM stays: at 64 rows it took 184 us for the four weights of an encoder layer against
# 250 here, at 256 rows 463 against 293 (H200, 2026-11-24).
MIN_ROWS = 128
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) below / from LARGE_ROWS rows: the fastest of six tilings at 256-512 and at
# 1664 rows (same H200 sweep). BLOCK_K is the same in both, so every output element sums its K in the same order.
TILES = ((64, 64, 32, 4, 4), (128, 64, 32, 4, 3))
LARGE_ROWS = 1024
GROUP_M = 8


@triton.jit(do_not_specialize=["M"])
def _encoder_gemm_kernel(X, W, BIAS, Y, M, N, K, s_xm, s_wn, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row blocks share each weight column block while it is in L2.
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pm = first_m + (pid % per_group) % size_m
    pn = (pid % per_group) // size_m
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, nm = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = (k0 + rk) < K
        x = tl.load(X + rm[:, None].to(tl.int64) * s_xm + (k0 + rk)[None, :], mask=mm[:, None] & km[None, :],
                    other=0.0)
        w = tl.load(W + rn[:, None].to(tl.int64) * s_wn + (k0 + rk)[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=nm, other=0.0)[None, :]
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    tl.store(Y + rm[:, None].to(tl.int64) * s_ym + rn[None, :], acc, mask=mm[:, None] & nm[None, :])


def input_precision(tf32: bool) -> str:
    """Triton's dot precision for the speech encoder's float32 kernels (this GEMM, encoder_attention.py): one TF32
    product with `tf32`, else three (float32 accuracy)."""
    return "tf32" if tf32 else "tf32x3"


def supported(x: torch.Tensor, weight: torch.Tensor, tf32: bool = False) -> bool:
    """2-D float32 input on CUDA with a row-major weight, of at least MIN_ROWS rows unless on TF32."""
    return (x.is_cuda and x.dim() == 2 and (tf32 or x.shape[0] >= MIN_ROWS) and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.stride(1) == 1 and x.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False,
           tf32: bool = False) -> torch.Tensor:
    """[gelu](x @ weight.T + bias) for x [M, K] float32 and weight [N, K], on TF32 if `tf32` (else at float32
    accuracy); cuBLAS (then torch's GELU) where `supported` says no."""
    if not supported(x, weight, tf32):
        y = torch.nn.functional.linear(x, weight, bias)
        return torch.nn.functional.gelu(y) if gelu else y
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns, the weight {weight.shape[1]}")
    y = torch.empty(m, n, device=x.device, dtype=torch.float32)
    bm, bn, bk, warps, stages = TILES[m >= LARGE_ROWS]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _encoder_gemm_kernel[grid](x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0),
                               weight.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
                               HAS_BIAS=bias is not None, GELU=gelu, PRECISION=input_precision(tf32),
                               num_warps=warps, num_stages=stages)
    return y
