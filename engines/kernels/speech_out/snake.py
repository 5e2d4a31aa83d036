"""Snake activation of the HiFT vocoder in one kernel: y = x + sin(alpha * x)^2 / (alpha + 1e-9), alpha per channel,
optionally with the conv bias and residual add before it.

torch runs the expression as seven kernels (alpha + eps, its reciprocal, alpha * x, sin, square, product, sum),
most of them a full pass over x; HiFT applies it 72 times per window, so at streaming batch sizes the vocoder's graph
was mostly these launches. Each Snake of a resblock follows a conv, whose bias torch adds in a kernel of its own,
and every other one a residual add too: `snake(x, alpha, bias)` and `add_snake(y, bias, residual, alpha)` take
those adds into the same pass. Float32 only, computed in the torch expressions' order with IEEE division, libdevice
sinf and no fused multiply-add, so the result equals torch's bit for bit (tests/gpu/test_hift_kernels.py).
x may be [B, C, T] contiguous or time-major ([B, T, C] in memory, HiFT's layout on CUDA:
engines/speech_out/vocoder/hift.py
`conv`); the outputs keep x's layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024


@triton.jit(do_not_specialize=["N", "T", "C"])
def _snake_kernel(X, BIAS, RES, ALPHA, Z, Y, N, T, C, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                  SNAKE: tl.constexpr, TIME_MAJOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    if TIME_MAJOR:  # memory [B, T, C]
        ch = offs % C
    else:  # memory [B, C, T]
        ch = (offs // T) % C
    x = tl.load(X + offs, mask=m, other=0.0)
    if HAS_BIAS:
        x = x + tl.load(BIAS + ch, mask=m, other=0.0)  # torch: conv output + bias
    if HAS_RES:
        x = tl.load(RES + offs, mask=m, other=0.0) + x  # torch: residual + (conv output + bias)
        tl.store(Z + offs, x, mask=m)
    if SNAKE:
        a = tl.load(ALPHA + ch, mask=m, other=1.0)
        inv = tl.math.div_rn(1.0, a + 1e-9)  # torch: reciprocal(alpha + 1e-9) * 1.0
        s = libdevice.sin(a * x)
        tl.store(Y + offs, x + inv * (s * s), mask=m)


def time_major(x: torch.Tensor) -> bool:
    """x [B, C, T] is dense with [B, T, C] memory order (and not also plain contiguous, as when C or T is 1)."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


def _dense_like(x: torch.Tensor, tm: bool) -> torch.Tensor:
    """x in time-major memory (tm) or contiguous, copied only where it is not already."""
    if tm:
        return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)
    return x if x.is_contiguous() else x.contiguous()


def _checked(x: torch.Tensor, name: str, C: int | None = None, like: torch.Tensor | None = None,
             tm: bool | None = None) -> torch.Tensor:
    """A float32 operand: [C] for per-channel ones (C given, contiguous), x's shape for `like` (in like's memory
    order: time-major if `tm`), else x [B, C, T] (contiguous unless time-major)."""
    if x.dtype != torch.float32:
        raise ValueError(f"snake takes float32 (got {name} {x.dtype})")
    if C is not None and x.shape != (C,):
        raise ValueError(f"snake takes {name} [C] = [{C}], got {tuple(x.shape)}")
    if C is None and like is None and x.dim() != 3:
        raise ValueError(f"snake takes x [B, C, T], got {tuple(x.shape)}")
    if like is not None and x.shape != like.shape:
        raise ValueError(f"snake takes {name} of x's shape {tuple(like.shape)}, got {tuple(x.shape)}")
    if like is not None:
        return _dense_like(x, time_major(like) if tm is None else tm)
    if C is not None:
        return x if x.is_contiguous() else x.contiguous()
    return _dense_like(x, time_major(x))


def _launch(x: torch.Tensor, alpha: torch.Tensor | None, bias: torch.Tensor | None,
            residual: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x = _checked(x, "x")
    C, tm = x.shape[1], time_major(x)
    alpha = None if alpha is None else _checked(alpha, "alpha", C)
    bias = None if bias is None else _checked(bias, "bias", C)
    residual = None if residual is None else _checked(residual, "residual", like=x, tm=tm)
    z = torch.empty_like(x) if residual is not None else None
    y = torch.empty_like(x) if alpha is not None else None
    n = x.numel()
    if n:
        _snake_kernel[(triton.cdiv(n, BLOCK),)](
            x, bias if bias is not None else x, residual if residual is not None else x,
            alpha if alpha is not None else x, z if z is not None else x, y if y is not None else x,
            n, x.shape[2], C, HAS_BIAS=bias is not None, HAS_RES=residual is not None, SNAKE=alpha is not None,
            TIME_MAJOR=tm, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return z, y


def snake(x: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T] float32 on CUDA, alpha [C], bias [C] or None -> Snake(x + bias), [B, C, T] in x's memory order
    (contiguous or time-major; other strides are made contiguous first)."""
    return _launch(x, alpha, bias, None)[1]


def add_snake(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, alpha: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """s = residual + (x + bias) for x, residual [B, C, T] float32 on CUDA, bias [C] or None; returns s and
    Snake(s) with `alpha` [C] (None without alpha)."""
    return _launch(x, alpha, bias, residual)
