"""The fp8 copies of a model's Linear weights (engines/lm/model/fp8.py): made after loading (`apply`), and the kernels
that read them tuned for every row count a step can bring, before any CUDA graph is captured (`tune_kernels`)."""

from __future__ import annotations

import torch

from engines.lm.model.fp8 import MAX_ROWS, quantize, round_weight
from engines.lm.model.layers import Linear


def apply(model: torch.nn.Module, keep_weights: bool = True) -> int:
    """Round every Linear weight of `model` to fp8 and give the layer its fp8 copy (Linear.fp8), which GEMMs of up to
    MAX_ROWS rows read on a GPU (engines/kernels/lm/skinny_gemm.py). `keep_weights`: the weight stays, overwritten with
    the rounded values, for larger GEMMs (cuBLAS); else it goes (None) and every GEMM reads the copy
    (engines/kernels/lm/fp8_gemm.py above MAX_ROWS rows; off a GPU, or in float32, the layer multiplies by the
    dequantized values). Returns the bytes the copies take."""
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
    from engines.kernels.lm import fp8_gemm, skinny_gemm  # Triton: imported on a GPU only

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
