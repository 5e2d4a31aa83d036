"""Snake activation of the HiFT vocoder in one kernel: y = x + sin(alpha * x)^2 / (alpha + 1e-9), alpha per channel.

torch runs the expression as seven kernels (alpha + eps, its reciprocal, alpha * x, sin, square, product, sum),
most of them a full pass over x; HiFT applies it 72 times per window, so at streaming batch sizes the vocoder's graph
was mostly these launches. Float32 only, computed in the torch expression's order with IEEE division, libdevice sinf
and no fused multiply-add, so the result equals torch's bit for bit (tests/gpu/test_codec_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024


@triton.jit(do_not_specialize=["N", "T", "C"])
def _snake_kernel(X, ALPHA, Y, N, T, C, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m, other=0.0)
    a = tl.load(ALPHA + (offs // T) % C, mask=m, other=1.0)
    inv = tl.math.div_rn(1.0, a + 1e-9)  # torch: reciprocal(alpha + 1e-9) * 1.0
    s = libdevice.sin(a * x)
    tl.store(Y + offs, x + inv * (s * s), mask=m)


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] float32 on CUDA, alpha [C] -> Snake(x), [B, C, T] contiguous."""
    if x.dtype != torch.float32 or alpha.dtype != torch.float32:
        raise ValueError(f"snake takes float32 (got x {x.dtype}, alpha {alpha.dtype})")
    if x.dim() != 3 or alpha.shape != (x.shape[1],):
        raise ValueError(f"snake takes x [B, C, T] and alpha [C], got {tuple(x.shape)} and {tuple(alpha.shape)}")
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _snake_kernel[(triton.cdiv(n, BLOCK),)](x, alpha, y, n, x.shape[2], x.shape[1], BLOCK=BLOCK, num_warps=4,
                                               enable_fp_fusion=False)
    return y
