"""Skinny GEMM for decode batches: y = x @ W.T with x [M <= 16, K] and W [N, K] (bf16/fp16, row-major), or
x [M <= 32, K] over an fp8 copy of W with power-of-two row scales (engines/lm/model/fp8.py: half the bytes).

At decode sizes a linear layer is a pass over its weight: time = bytes / bandwidth. cuBLAS picks
GEMM tilings meant for larger M and reaches 73-95% of copy bandwidth on this model's shapes (o_proj
the worst; 2026-11-22). This kernel gives each program BLOCK_N weight rows and streams them along K with a
software-pipelined loop (M padded to the 16 rows of one tensor-core tile), so the whole GPU is busy
reading the weight once.

Which tiling wins depends on (N, K) and the GPU, so the first eager call of a shape times every
candidate (and cuBLAS) on rotated weight copies larger than L2, and keeps the fastest. This runs
before CUDA-graph capture (the graph warm-up makes those calls); a shape first seen while a graph is
being captured falls back to cuBLAS, so capture never syncs or times anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engines.kernels import tuning as tuning_file
from engines.kernels.lm import fp8_gemm
from engines.kernels.lm.gemm_common import operands, reduce_splits, time_per_call, time_tilings, weight_copies
from engines.kernels.pdl import enabled, launch_kwargs, wait_then_trigger
from engines.lm.model.fp8 import MAX_ROWS as FP8_MAX_ROWS

MAX_ROWS = 16  # one tensor-core tile of rows; larger batches go to cuBLAS
# Without programmatic dependent launch, take the Triton kernel only where it beats cuBLAS by at least 2%; with it
# (engines/kernels/pdl.py), unless cuBLAS beats it by 2%: in a step the Triton kernel launches under its
# predecessor's tail, which a tuning run of one kernel shows only in part (gate_up: 47.8 vs 48.5 us alone, H200).
_WIN_MARGIN = {False: 0.98, True: 1.02}

# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K). Split-K (partial sums through a float32 buffer and a
# reduce) is for GPUs where N / BLOCK_N leaves SMs idle; on the H100 it lost on every model shape.
# (Persistent tilings, a few programs per SM walking the N tiles, never won on the H200.)
Config = tuple[int, int, int, int, int]
CANDIDATES: tuple[Config, ...] = (
    (16, 256, 4, 4, 1), (16, 256, 4, 6, 1), (16, 512, 4, 3, 1), (16, 512, 4, 4, 1),
    (32, 128, 4, 6, 1), (32, 128, 4, 8, 1), (32, 256, 4, 4, 1), (32, 256, 4, 5, 1), (32, 256, 4, 6, 1),
    (32, 512, 4, 3, 1), (64, 128, 4, 4, 1), (64, 128, 4, 6, 1), (64, 256, 4, 3, 1), (64, 256, 8, 4, 1),
    (32, 256, 4, 4, 2), (64, 128, 4, 4, 2),
)
# Over an fp8 weight a stage holds half the bytes: shallower pipelines and split-K (more programs for the N=4096
# shapes) won there (H200)
FP8_CANDIDATES = CANDIDATES + ((32, 256, 4, 3, 1), (32, 256, 4, 3, 2), (64, 256, 4, 3, 2), (64, 256, 4, 3, 4))

# (N, K, weight dtype, tile rows) -> chosen config, or None for cuBLAS
_choice: dict[tuple[int, int, torch.dtype, int], Config | None] = {}
# per tuned shape: {"cublas": s, config: s}, seconds per call inside a CUDA graph (for the benchmark notes)
timings: dict[tuple[int, int, torch.dtype, int], dict] = {}


# M (rows) changes with every batch the text head sees outside the graphs: specializing on it (M == 1,
# M % 16 == 0) compiled a new kernel mid-serving, a 100-500 ms stall. It only masks rows.
#
# GLU: W is (gate; up) [2F, K]; program i reads BLOCK_N / 2 gate rows and the up rows of the same F columns, and its
# epilogue writes silu(gate) * up [M, F], rounded as the separate kernel rounds it (bit-identical to it): the MLP's
# SiLU*up kernel is gone from decode steps. (The RMSNorms and residual adds in the GEMMs' epilogues, or any such
# work on the input tiles inside the K loop, measured slower.)
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(X, W, S, Y, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                   SPLIT_K: tl.constexpr, GLU: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_then_trigger(PDL)
    if GLU:  # N = F here
        half = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        cols = pid * half + j % half  # [BLOCK_N] the output (F) column of each weight row
        n_ok = cols < N
        offs_n = cols + (j // half) * N  # gate rows, then the matching up rows
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    w_ptrs = W + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if SCALED:  # fp8 weight: exact in fp16 and bf16; its row's power-of-two scale comes after the sums. (Through
            # fp16: Triton's direct e4m3 -> bf16 conversion measured ~20% slower on gate_up, H200.)
            w = w.to(tl.float16).to(X.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc)  # [BLOCK_M, BLOCK_N], float32
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SCALED:  # a power of two per weight row: exact, so these are the sums over the weight's bf16 values
        acc = acc * tl.load(S + offs_n, mask=n_ok, other=1.0)[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if GLU:
        dt = Y.dtype.element_ty
        y = tl.reshape(acc.to(dt).to(tl.float32), (BLOCK_M, 2, BLOCK_N // 2))  # the GEMM's output, rounded
        g, u = tl.split(tl.permute(y, (0, 2, 1)))  # [BLOCK_M, BLOCK_N / 2] each
        act = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
        offs_f = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_f[None, :], act, mask=m_ok[:, None] & (offs_f < N)[None, :])
    elif SPLIT_K == 1:
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=out_mask)
    else:  # Y is the float32 partial buffer [SPLIT_K, M, N]
        tl.store(Y + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=out_mask)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Half-precision 2-D decode-sized input on CUDA (float32 stays on cuBLAS: tl.dot would round to tf32)."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dtype in (torch.bfloat16,
            torch.float16) and x.dtype == weight.dtype and weight.stride(1) == 1)


def launch(x: torch.Tensor, weight: torch.Tensor, config: Config, out: torch.Tensor | None = None,
           glu: bool = False, block_m: int = MAX_ROWS, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= block_m, K] @ weight[N, K].T with one tiling; out [M, N] (contiguous) if given. `glu` (one-pass
    tilings only): the weight is (gate; up) [2F, K] and the output silu(gate) * up [M, F]. `block_m` (a power of two
    >= 16): rows of the one tile every program holds (benchmarks try more than MAX_ROWS). `scale` ([N] float32,
    powers of two) with an fp8 weight: x @ (weight * scale[:, None]).T (engines/lm/model/fp8.py)."""
    block_n, block_k, warps, stages, split = config
    m, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    if (scale is not None) != (weight.dtype == torch.float8_e4m3fn):
        raise ValueError(f"a {weight.dtype} weight {'needs' if scale is None else 'takes no'} row scales")
    if split > 1 and (glu or k % (split * block_k)):
        raise ValueError("the GLU epilogue needs a one-pass tiling (split-K 1)" if glu else
                         f"split-K {split} x {block_k} does not divide K={k}")
    if k != weight.shape[1]:
        raise ValueError(f"x has {k} columns, the weight {weight.shape[1]}")
    if m > block_m:
        raise ValueError(f"x has {m} rows, more than the tile's {block_m}")
    x, out, dst = operands(x, n, split, out)
    tile_n = block_n // 2 if glu else block_n  # output columns per program
    _skinny_kernel[(triton.cdiv(n, tile_n), split)](
        x, weight, weight if scale is None else scale, dst, m, n, k, k // split if split > 1 else k, x.stride(0),
        weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        EVEN_N=n % tile_n == 0, SPLIT_K=split, GLU=glu, SCALED=scale is not None, num_warps=warps,
        num_stages=stages, **launch_kwargs(x.device))
    if split > 1:
        reduce_splits(dst, out)
    return out


def time_candidates(x: torch.Tensor, copies: list[torch.Tensor], block_m: int = MAX_ROWS, rounds: int = 4,
                    scale: torch.Tensor | None = None) -> dict[Config, float]:
    """Seconds per call of x @ w.T for every candidate tiling that runs here (copies: the weight's rotated copies;
    `scale`: their row scales where they are fp8)."""
    out = torch.empty(x.shape[0], copies[0].shape[0], device=x.device, dtype=x.dtype)
    return time_tilings(CANDIDATES if scale is None else FP8_CANDIDATES,
                        lambda w, cfg: launch(x, w, cfg, out, block_m=block_m, scale=scale), copies, rounds)


def _key(weight: torch.Tensor, block_m: int) -> tuple[int, int, torch.dtype, int]:
    return weight.shape[0], weight.shape[1], weight.dtype, block_m


def tune(weight: torch.Tensor, rows: int = 1, scale: torch.Tensor | None = None, act_dtype: torch.dtype | None = None,
         block_m: int = MAX_ROWS) -> Config | None:
    """Time every candidate and cuBLAS on this weight's shape; remember and return the winner (None: cuBLAS).
    An fp8 weight (with its `scale`, for activations of `act_dtype`) has no cuBLAS: the best tiling wins."""
    copies = weight_copies(weight, scale)
    x = torch.randn(rows, weight.shape[1], device=weight.device, dtype=act_dtype or weight.dtype)
    result = time_candidates(x, copies, block_m, scale=scale)
    if scale is None:
        result["cublas"] = time_per_call(lambda w: F.linear(x, w), copies)
    del copies
    best = min((c for c in result if c != "cublas"), key=result.__getitem__, default=None)
    margin = _WIN_MARGIN[enabled(weight.device)]
    choice = best if best is not None and (scale is not None or result[best] < margin * result["cublas"]) else None
    _choice[_key(weight, block_m)] = choice
    timings[_key(weight, block_m)] = result
    return choice


def offered(fp8: bool) -> tuple[Config | None, ...]:
    """The choices the tuner may make for a weight: its tilings, and over a bf16 weight None (cuBLAS)."""
    return FP8_CANDIDATES if fp8 else (*CANDIDATES, None)


def config_for(weight: torch.Tensor, scale: torch.Tensor | None = None, act_dtype: torch.dtype | None = None,
               block_m: int = MAX_ROWS) -> Config | None:
    """The tuned tiling of this weight's shape (tuned now unless a capture is running); None: cuBLAS (over the
    half-precision weight)."""
    key = _key(weight, block_m)
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():
            return None  # untuned shape inside a capture: no timing possible here
        choices = offered(fp8=scale is not None)
        _choice[key] = tuning_file.choose(
            "skinny", key, weight.device, valid=lambda c: c in choices,
            tune=lambda: tune(weight, 1 if block_m == MAX_ROWS else block_m, scale, act_dtype, block_m))
    return _choice[key]


def _fp8_tiling(x: torch.Tensor, fp8: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[Config | None, int]:
    """(tiling, tile rows) for x over the fp8 copy (w8, scale) of a weight; (None, 0) where it does not run."""
    if fp8 is None or not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= FP8_MAX_ROWS
                           and x.dtype in (torch.bfloat16, torch.float16)):
        return None, 0
    block_m = fp8_tile(x.shape[0])
    return config_for(fp8[0], fp8[1], x.dtype, block_m), block_m


def fp8_tile(rows: int) -> int:
    """The tile rows (tuned separately) a GEMM of `rows` <= fp8.MAX_ROWS rows over an fp8 copy runs with."""
    return max(MAX_ROWS, triton.next_power_of_2(rows))


def glu(x: torch.Tensor, weight: torch.Tensor | None, fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        ) -> torch.Tensor | None:
    """silu(gate) * up of x @ (gate; up).T in one kernel, or None where it cannot run (rows not decode-sized,
    or the shape tuned to cuBLAS or split-K). `fp8`: the weight's fp8 copy (w8, scale), read instead of it where the
    rows allow (engines/lm/model/fp8.py); `weight` None: the layer keeps only that copy."""
    cfg, block_m = _fp8_tiling(x, fp8)
    if cfg is not None:
        return launch(x, fp8[0], cfg, glu=True, block_m=block_m, scale=fp8[1]) if cfg[4] == 1 else None
    if weight is None or not supported(x, weight):
        return None
    cfg = config_for(weight)
    return launch(x, weight, cfg, glu=True) if cfg is not None and cfg[4] == 1 else None


def linear(x: torch.Tensor, weight: torch.Tensor | None, fp8: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> torch.Tensor:
    """F.linear(x, weight), through the tuned kernel where the rows are decode-sized and it beats cuBLAS. `fp8`: the
    weight's fp8 copy (w8, scale), read instead of it where the rows allow (engines/lm/model/fp8.py). `weight` None:
    the layer keeps only the fp8 copy, and larger row counts go to the fp8 GEMM (engines/kernels/lm/fp8_gemm.py)."""
    cfg, block_m = _fp8_tiling(x, fp8)
    if cfg is not None:
        return launch(x, fp8[0], cfg, block_m=block_m, scale=fp8[1])
    if weight is None:
        if fp8 is None:
            raise ValueError("a linear layer with neither a weight nor an fp8 copy")
        return fp8_gemm.linear(x, *fp8)
    cfg = config_for(weight) if supported(x, weight) else None
    return F.linear(x, weight) if cfg is None else launch(x, weight, cfg)
