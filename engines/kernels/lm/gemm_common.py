"""What the two GEMMs over decode-step weights (skinny_gemm.py, fp8_gemm.py) share: their operand and split-K buffers,
the split-K reduce, and the timing of candidate tilings, replayed in CUDA graphs over weight copies larger than L2."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from engines.lm.step_graphs import private_stream

_L2_DEFEAT_BYTES = 256 << 20  # rotate weight copies over this many bytes when timing (H100 L2: 50 MB)


@triton.jit
def _split_reduce_kernel(P, Y, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(P + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


def operands(x: torch.Tensor, n: int, split: int, out: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x with unit column stride, out [M, n], where the kernel writes: out, or float32 partials [split, M, n] for
    `reduce_splits`)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    return x, out, out if split == 1 else torch.empty(split, x.shape[0], n, device=x.device, dtype=torch.float32)


def reduce_splits(partials: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] (contiguous) = the sum of split-K partials [SPLIT_K, M, N] (float32), rounded once."""
    mn = out.numel()
    _split_reduce_kernel[(triton.cdiv(mn, 1024),)](partials, out, mn, SPLIT_K=partials.shape[0], BLOCK=1024,
                                                   num_warps=4)


@functools.cache
def _tuner_stream(device: torch.device) -> torch.cuda.Stream:
    return private_stream(device)


def time_per_call(fn, copies: list[torch.Tensor], rounds: int = 4) -> float:
    """Seconds per call with the calls replayed from a CUDA graph, as the decode step runs them (eager timing
    would measure Triton's host-side launch cost instead of the kernel)."""
    for w in copies[:2]:
        fn(w)  # compiles, and fails here (not inside the capture) when a tiling does not fit
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Captured on a stream of the tuner's own: this graph is destroyed after timing, which drops its capture
    # stream's cuBLAS workspaces (see engines.lm.step_graphs.private_stream).
    with torch.cuda.graph(graph, stream=_tuner_stream(copies[0].device)):
        for _ in range(rounds):
            for w in copies:
                fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / (3 * rounds * len(copies))


def time_tilings(candidates, call, copies: list[torch.Tensor], rounds: int) -> dict:
    """Seconds per call of `call(w, config)` over the rotated copies for every candidate that runs here (both
    GEMMs' tuners). One the launch refuses (a split-K that does not divide K) or that does not fit this GPU (shared
    memory, registers) fails in time_per_call's warm-up, before any capture, and is skipped."""
    result = {}
    for cfg in candidates:
        try:
            result[cfg] = time_per_call(lambda w, cfg=cfg: call(w, cfg), copies, rounds)
        except Exception:  # noqa: BLE001 - see above: a tiling that cannot run here is not a candidate
            continue
    return result


def weight_copies(weight: torch.Tensor, scale: torch.Tensor | None) -> list[torch.Tensor]:
    """The weight and random copies of it, together larger than L2 (an fp8 weight's copies are fp8 as well)."""
    nbytes = weight.numel() * weight.element_size()
    # at most 16 copies: a weight too small to defeat L2 with them is cheap whichever kernel runs it
    extra = min(15, max(0, math.ceil(_L2_DEFEAT_BYTES / nbytes) - 1))
    dtype = torch.bfloat16 if scale is not None else weight.dtype
    return [weight] + [torch.randn(weight.shape, device=weight.device, dtype=dtype).to(weight.dtype)
                       for _ in range(extra)]
