"""Weights rounded to fp8 (e4m3) with a power-of-two scale per output row.

A decode step reads every weight once, so its time is the weights' bytes over the HBM bandwidth (docs/BENCHMARKS.md):
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


def apply(model: torch.nn.Module, keep_weights: bool = True) -> int:
    """Round every Linear weight of `model` to fp8 and give the layer its fp8 copy (Linear.fp8), which GEMMs of up to
    MAX_ROWS rows read on a GPU (engines/kernels/lm/skinny_gemm.py). `keep_weights`: the weight stays, overwritten with
    the rounded values, for larger GEMMs (cuBLAS); else it goes (None) and every GEMM reads the copy
    (engines/kernels/lm/fp8_gemm.py above MAX_ROWS rows; off a GPU, or in float32, the layer multiplies by the
    dequantized values). Returns the bytes the copies take."""
    from engines.lm.model.layers import Linear

    if model.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8 weights need a bfloat16 or float32 model (their values must be exact in its dtype), "
                         f"got {model.dtype}")
    total = 0
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, Linear) and layer.weight is not None:
                if keep_weights:
                    layer.fp8 = round_weight(layer.weight)
                else:
                    layer.fp8 = quantize(layer.weight)
                    layer.weight = None  # goes now: peak memory is one layer's float32 copy
                total += layer.fp8[0].numel() + layer.fp8[1].numel() * 4
    return total


def tune_kernels(model: torch.nn.Module, max_rows: int, max_head_rows: int) -> int:
    """On a GPU, before any CUDA graph is captured: tune the fp8 kernels for every weight shape of `model` at every
    row count a step can bring that reads the copies (the decoder layers up to `max_rows`, the heads up to
    `max_head_rows`: they see only the rows that need logits; past MAX_ROWS only where the layer kept no weight). A
    shape first met while serving would compile and time its tilings there, a stall of seconds. Returns the
    (shape, tile or bucket) pairs tuned."""
    from engines.kernels.lm import fp8_gemm, skinny_gemm
    from engines.lm.model.layers import Linear

    heads = {id(getattr(model, n, None)) for n in ("text_lm_head", "audio_lm_head")}
    todo: dict[tuple[int, int], tuple[tuple[torch.Tensor, torch.Tensor], int]] = {}
    for layer in model.modules():
        if isinstance(layer, Linear) and layer.fp8 is not None and layer.fp8[0].is_cuda:
            limit = max_head_rows if id(layer) in heads else max_rows
            key = (*layer.fp8[0].shape, layer.weight is None)
            todo[key] = (layer.fp8, max(limit, todo[key][1] if key in todo else 0))
    n = 0
    for (_, _, only), ((w8, scale), limit) in todo.items():
        # the tiles and buckets the dispatch picks for each row count (skinny_gemm.linear / glu)
        tiles = {skinny_gemm.fp8_tile(r) for r in range(1, min(limit, MAX_ROWS) + 1)}
        buckets = {fp8_gemm.bucket(r) for r in range(MAX_ROWS + 1, limit + 1)} if only else set()
        for tile in sorted(tiles):
            skinny_gemm.config_for(w8, scale, model.dtype, tile)
        for rows in sorted(buckets):
            fp8_gemm.config_for(w8, scale, rows, model.dtype)
        n += len(tiles) + len(buckets)
    return n
