"""Weights rounded to fp8 (e4m3) with a power-of-two scale per output row.

A decode step reads every weight once, so its time is the weights' bytes over the HBM bandwidth (docs/performance.md):
an fp8 copy halves what the decode-sized GEMMs read. The scale of each row is the power of two that brings its
largest magnitude into e4m3's range, so w8 * scale is exactly a bf16 (or float32) number: the model with fp8 weights
is the same model as the bf16 one whose weights are `dequantize(quantize(w))`, and a GEMM over the fp8 copy that
applies the scale after its sums computes the same sums (scaling by a power of two is exact; the compiled kernels may
still order the sums differently from the bf16 kernel's: H200, some tilings bit-identical, others within rounding).
This rounding does change the model against the published bf16 weights (4 significant bits instead of 8), which is
why it is an option (`EngineConfig.fp8_weights`), off unless asked for. (float16 is refused: e4m3's smallest values
times a small row scale fall below float16's range.)
"""

from __future__ import annotations

import torch

from engines.config import FP8_MAX

FP8 = torch.float8_e4m3fn
# Steps of up to this many rows read the fp8 copy through the skinny kernel (engines/kernels/lm/skinny_gemm.py), more
# through the fp8 GEMM (engines/kernels/lm/fp8_gemm.py)
MAX_ROWS = 32


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w8 [N, K] fp8, scale [N] float32, powers of two) with w8 * scale[:, None] ~= w."""
    amax = w.abs().amax(dim=1).float()  # [N]
    # The smallest power of two with |w| / scale <= FP8_MAX. frexp: amax / FP8_MAX = mantissa * 2**exponent with
    # mantissa in [0.5, 1); at 0.5 the power below is enough (so weights rounded once round to themselves again).
    mantissa, exponent = torch.frexp(amax / FP8_MAX)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax))  # [N]
    w8 = (w.float() / scale[:, None]).to(FP8)  # division by a power of two: only the cast rounds
    return w8, scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact half-precision value of every fp8 weight: w8 [N, K], scale [N] -> [N, K] in `dtype`."""
    return (w8.float() * scale[:, None]).to(dtype)


def round_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w in place of its own values: w becomes dequantize(w8, scale); returns (w8, scale)."""
    w8, scale = quantize(w)
    w.copy_(dequantize(w8, scale, w.dtype))
    return w8, scale
