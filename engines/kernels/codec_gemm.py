"""The codec estimator's GEMMs above streaming sizes, with their elementwise tails in the epilogue (GPU only).

Above LN_LINEAR_MAX_ROWS rows (9+ sessions: the rounds of playing answers) a transformer block ran as eight
kernels: add + LayerNorm, q/k/v (cuBLAS), window attention, to_out (cuBLAS), add + LayerNorm, ff.net.0 (cuBLAS),
GELU, ff.net.2 (cuBLAS). At 32 sessions (2,560 rows) on an H100 the three elementwise kernels were 27% of the
block's GPU time (add + LayerNorm 3.5 us twice, GELU 4.5 us, against 5-7 us per GEMM: docs/PERF_NOTES.md,
session 38). Here a pipelined GEMM takes them into its epilogue:
- `linear_ln`: y = x @ W.T + bias, s = y + residual, h = LayerNorm(s) -> (h, s). A program holds whole rows of the
  output (BLOCK_N = N, the model width), so the LayerNorm needs no second pass. to_out and ff.net.2 feed the next
  LayerNorm this way, and the block becomes five kernels.
- `linear_act`: y = x @ W.T + bias, then GELU (ff.net.0) or + residual (a stack's last ff.net.2).

Rounding follows the torch path it replaces (F.linear rounds its output, the add rounds, LayerNorm reads the
rounded sum in float32, GELU reads the rounded linear output), so results differ from it only by the GEMM's own
summation order. bf16 / fp16 only: float32 estimators keep the torch path (no TF32 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _gelu_erf(y):
    return 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))


@triton.jit(do_not_specialize=["M"])
def _gemm_epilogue_kernel(X, W, BIAS, RES, LNW, LNB, Y, S, M, N, K: tl.constexpr, eps, stride_xm,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                          LN: tl.constexpr, GELU: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, nm = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(X + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=mm[:, None], other=0.0)  # [BM, BK]
        w = tl.load(W + rn[None, :] * K + (k0 + rk)[:, None], mask=nm[None, :], other=0.0)  # [BK, BN] of W [N, K]
        acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    dt = Y.dtype.element_ty
    om = mm[:, None] & nm[None, :]
    y = acc.to(dt)  # F.linear's rounded output
    if GELU:
        y = _gelu_erf(y.to(tl.float32)).to(dt)
    if HAS_RES:
        y = (y.to(tl.float32) + tl.load(RES + rm[:, None] * N + rn[None, :], mask=om, other=0.0).to(tl.float32))
        y = y.to(dt)
    if LN:  # BLOCK_N == N: the program holds whole rows
        tl.store(S + rm[:, None] * N + rn[None, :], y, mask=om)
        s = y.to(tl.float32)
        mean = tl.sum(s, 1) / N
        d = tl.where(nm[None, :], s - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / N + eps)
        lw = tl.load(LNW + rn, mask=nm, other=0.0).to(tl.float32)
        lb = tl.load(LNB + rn, mask=nm, other=0.0).to(tl.float32)
        y = (d * rstd[:, None] * lw[None, :] + lb[None, :]).to(dt)
    tl.store(Y + rm[:, None] * N + rn[None, :], y, mask=om)


@dataclass(frozen=True)
class WideTiles:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the two epilogue kinds; BLOCK_N of `ln` is the row width.
    A development knob like codec_fused.StreamTiles: `python3 -m engines.bench.profile_codec --wide` times the solve
    graph per variant."""

    ln: tuple[int, int, int, int] = (64, 64, 8, 3)  # BLOCK_M, BLOCK_K, warps, stages
    act: tuple[int, int, int, int, int] = (128, 128, 64, 8, 3)

    def __post_init__(self) -> None:
        for name, v in (("ln", self.ln[:2]), ("act", self.act[:3])):
            if any(x < 16 or x & (x - 1) for x in v):
                raise ValueError(f"WideTiles.{name} blocks must be powers of two >= 16, got {v}")


WIDE_TILES = WideTiles()
LN_MAX_N = 512  # widest row a `linear_ln` program holds (the real codec's is 256)
# The estimator's transformer blocks take these kernels from this many rows (codec_fused.ln_linear's fused path ends
# at LN_LINEAR_MAX_ROWS = 640; set to a huge value to time the unfused path).
WIDE_MIN_ROWS = 641


def _block_k(k: int, tile_k: int) -> int:
    """The K tile for a reduction of k: the tiling's, or k itself when k is a smaller power of two (0: neither)."""
    if k % tile_k == 0:
        return tile_k
    return k if 16 <= k < tile_k and k & (k - 1) == 0 else 0


def supported(x: torch.Tensor, weight: torch.Tensor, ln: bool = False) -> bool:
    """Whether these kernels take x [..., K] @ weight [N, K].T: CUDA, bf16/fp16, K a multiple of the K tile (or a
    smaller power of two), row-contiguous x and weight, and for `ln` a power-of-two N up to LN_MAX_N."""
    n, k = weight.shape
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.shape[-1] == k and _block_k(k, WIDE_TILES.ln[1] if ln else WIDE_TILES.act[2]) > 0
            and x.stride(-1) == 1 and weight.is_contiguous()
            and (not ln or (n & (n - 1) == 0 and 16 <= n <= LN_MAX_N)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [M, K] with unit column stride (a view where the layout allows)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
            y: torch.Tensor, s: torch.Tensor | None, ln: tuple[torch.Tensor, torch.Tensor, float] | None,
            gelu: bool, tiles: tuple[int, int, int, int, int]) -> None:
    m, k = x2.shape
    n = weight.shape[0]
    bm, bn, bk, warps, stages = tiles
    bk = _block_k(k, bk)
    lw, lb, eps = ln if ln is not None else (weight, weight, 0.0)
    _gemm_epilogue_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, weight, bias if bias is not None else weight, residual if residual is not None else y, lw, lb, y,
        s if s is not None else y, m, n, K=k, eps=eps, stride_xm=x2.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        NUM_STAGES=stages, HAS_BIAS=bias is not None, HAS_RES=residual is not None, LN=ln is not None, GELU=gelu,
        num_warps=warps)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, ln: bool) -> None:
    if not supported(x, weight, ln):
        raise ValueError(f"codec_gemm does not take x {tuple(x.shape)} {x.dtype} @ weight {tuple(weight.shape)} "
                         f"{weight.dtype} (see codec_gemm.supported)")
    want = (*x.shape[:-1], weight.shape[0])
    if residual is not None and (tuple(residual.shape) != want or not residual.is_contiguous()):
        raise ValueError(f"residual {tuple(residual.shape)} must be a contiguous {want}")


def linear_ln(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
              ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """s = F.linear(x, weight, bias) + residual, h = LayerNorm(s) over the N output channels, in one kernel.
    x [..., K], weight [N, K], residual [..., N] contiguous. Returns (h, s), both [..., N] contiguous."""
    _check(x, weight, residual, ln=True)
    x2 = _rows(x)
    y = torch.empty(*x.shape[:-1], weight.shape[0], device=x.device, dtype=x.dtype)
    s = torch.empty_like(y)
    if x2.shape[0]:
        bm, bk, warps, stages = WIDE_TILES.ln
        _launch(x2, weight, bias, residual, y, s, (ln_weight, ln_bias, eps), False,
                (bm, weight.shape[0], bk, warps, stages))
    return y, s


def linear_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), then exact (erf) GELU or + residual ([..., N] contiguous), in one kernel."""
    if gelu and residual is not None:
        raise ValueError("linear_act takes GELU or a residual, not both")
    _check(x, weight, residual, ln=False)
    x2 = _rows(x)
    y = torch.empty(*x.shape[:-1], weight.shape[0], device=x.device, dtype=x.dtype)
    if x2.shape[0]:
        _launch(x2, weight, bias, residual, y, None, None, gelu, WIDE_TILES.act)
    return y
