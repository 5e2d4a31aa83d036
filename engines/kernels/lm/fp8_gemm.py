"""GEMM over an fp8 weight for more rows than a decode step's: y = x @ (w8 * scale[:, None]).T, x [M, K] bf16.

With `EngineConfig.fp8_only` the model keeps only the fp8 copies of its linear weights (engines/lm/model/fp8.py), so
prefill and the larger mixed steps need a GEMM that reads them too (decode-sized rows go to
engines/kernels/lm/skinny_gemm.py). Each program owns a [BLOCK_M, BLOCK_N] output tile and walks K: the fp8 weight
tile is converted in registers (through fp16, exact) and multiplied in bf16 with float32 sums; the row scale (a power
of two) comes after the sums, so the result is the GEMM over the weight's bf16 values.

SWAP puts the weight tile first in the product (acc^T = W x^T): the converted tile then feeds the tensor cores
from registers instead of going back through shared memory; which form wins depends on the shape (tuned per shape
and row bucket, as the skinny kernel is).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels import tuning as tuning_file
from engines.kernels.lm.gemm_common import operands, reduce_splits, time_tilings, weight_copies
from engines.kernels.pdl import launch_kwargs, wait_then_trigger

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP, SPLIT_K). Split-K (float32 partial sums and a reduce)
# gives the N=4096 shapes at a few row tiles enough programs to fill the GPU.
Config = tuple[int, int, int, int, int, bool, int]
CANDIDATES: tuple[Config, ...] = (
    (64, 128, 64, 4, 4, False, 1), (64, 128, 128, 4, 3, False, 1), (128, 128, 64, 8, 4, False, 1),
    (128, 128, 128, 8, 3, False, 1), (64, 256, 64, 8, 4, False, 1), (128, 256, 64, 8, 3, False, 1),
    (64, 128, 64, 4, 4, True, 1), (64, 128, 128, 4, 3, True, 1), (128, 128, 64, 8, 4, True, 1),
    (128, 128, 128, 8, 3, True, 1), (64, 256, 64, 8, 4, True, 1), (128, 256, 64, 8, 3, True, 1),
    (64, 64, 128, 4, 4, False, 1), (64, 64, 128, 4, 4, True, 1), (64, 64, 256, 4, 3, True, 1),
    (64, 64, 128, 4, 4, True, 2), (64, 64, 128, 4, 4, True, 4), (64, 128, 64, 4, 4, False, 2),
    (64, 128, 128, 4, 3, True, 2), (64, 128, 128, 4, 3, True, 4), (128, 128, 64, 8, 4, True, 2),
    (64, 64, 256, 4, 3, False, 4), (128, 64, 128, 4, 3, True, 1), (128, 64, 128, 4, 3, True, 2),
    (128, 64, 256, 8, 3, True, 1),
    # Three stages of K 128: room for more than one program an SM (three of 256 hold 128 KiB: one). gate_up at 48 / 64
    # rows on an H100: 42.2 / 42.8 us against 50.8 / 51.1 for the best of the others (2026-11-27)
    (64, 64, 128, 4, 3, True, 1),
)
# A shape first met while a CUDA graph is being captured runs this (no timing can happen inside a capture)
DEFAULT: Config = (128, 128, 64, 8, 4, False, 1)
MIN_BUCKET = 64  # rows are tuned in power-of-two buckets from here up to MAX_BUCKET
MAX_BUCKET = 1024

_choice: dict[tuple[int, int, int], Config] = {}  # (N, K, row bucket) -> tiling
timings: dict[tuple[int, int, int], dict[Config, float]] = {}  # per tuned key: seconds per call (benchmarks)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(X, W, S, Y, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                     SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    # Row tiles vary fastest: the programs that read one weight tile run together, so it comes from HBM once.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    pid_k = tl.program_id(1)
    wait_then_trigger(PDL)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None] * stride_wn + offs_k[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w = w.to(tl.float16).to(X.dtype.element_ty)  # exact: every e4m3 value is a float16 and a bf16 value
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
        else:
            acc = tl.dot(x, tl.trans(w), acc)  # [BLOCK_M, BLOCK_N]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # The row scales are powers of two: exact, also on each split's partial sums
    scale = tl.load(S + offs_n, mask=n_ok, other=1.0)  # [BLOCK_N]
    if SPLIT_K > 1:  # Y is the float32 partial buffer [SPLIT_K, M, N]
        Y += pid_k * M * N
    if SWAP:
        y = (acc * scale[:, None]).to(Y.dtype.element_ty)
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], y, mask=n_ok[:, None] & m_ok[None, :])
    else:
        y = (acc * scale[None, :]).to(Y.dtype.element_ty)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def launch(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, config: Config,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ (w8 [N, K] fp8 * scale [N]).T with one tiling; out [M, N] if given."""
    block_m, block_n, block_k, warps, stages, swap, split = config
    m, k = x.shape
    n = w8.shape[0]
    if w8.dtype != torch.float8_e4m3fn or scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"expected an e4m3 weight with [N] float32 scales, got {w8.dtype} and {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if k != w8.shape[1]:
        raise ValueError(f"x has {k} columns, the weight {w8.shape[1]}")
    if split > 1 and k % (split * block_k):
        raise ValueError(f"split-K {split} x {block_k} does not divide K={k}")
    x, out, dst = operands(x, n, split, out)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)
    _fp8_gemm_kernel[grid](x, w8, scale, dst, m, n, k, k // split, x.stride(0), w8.stride(0), dst.stride(-2),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, SWAP=swap,
                           SPLIT_K=split, num_warps=warps, num_stages=stages, **launch_kwargs(x.device))
    if split > 1:
        reduce_splits(dst, out)
    return out


def bucket(rows: int) -> int:
    """The power-of-two row bucket a GEMM of `rows` rows is tuned at (MIN_BUCKET..MAX_BUCKET)."""
    return min(MAX_BUCKET, max(MIN_BUCKET, triton.next_power_of_2(rows)))


def time_candidates(x: torch.Tensor, copies: list[torch.Tensor], scale: torch.Tensor, rounds: int = 4
                    ) -> dict[Config, float]:
    """Seconds per call of every candidate that runs here (copies: the fp8 weight's rotated copies)."""
    out = torch.empty(x.shape[0], copies[0].shape[0], device=x.device, dtype=x.dtype)
    return time_tilings(CANDIDATES, lambda w, cfg: launch(x, w, scale, cfg, out), copies, rounds)


def tune(w8: torch.Tensor, scale: torch.Tensor, rows: int, act_dtype: torch.dtype) -> Config:
    """Time every candidate at `rows` rows on this weight's shape; remember and return the fastest."""
    key = (w8.shape[0], w8.shape[1], bucket(rows))
    copies = weight_copies(w8, scale)
    x = torch.randn(key[2], w8.shape[1], device=w8.device, dtype=act_dtype)
    result = time_candidates(x, copies, scale)
    del copies
    if not result:
        raise RuntimeError(f"no fp8 GEMM tiling runs on this GPU for a {tuple(w8.shape)} weight")
    _choice[key] = min(result, key=result.__getitem__)
    timings[key] = result
    return _choice[key]


def config_for(w8: torch.Tensor, scale: torch.Tensor, rows: int, act_dtype: torch.dtype) -> Config:
    """The tiling tuned for this weight's shape at `rows`' bucket (tuned now; DEFAULT inside a capture)."""
    key = (w8.shape[0], w8.shape[1], bucket(rows))
    cfg = _choice.get(key)
    if cfg is None:
        if torch.cuda.is_current_stream_capturing():
            return DEFAULT
        cfg = _choice[key] = tuning_file.choose("fp8_gemm", key, w8.device, valid=lambda c: c in CANDIDATES,
                                                tune=lambda: tune(w8, scale, rows, act_dtype))
    return cfg


def linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (w8 * scale).T through the tiling tuned for M's bucket."""
    return launch(x, w8, scale, config_for(w8, scale, x.shape[0], x.dtype))
