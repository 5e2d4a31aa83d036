"""What every codec estimator kernel shares: launch settings by row count (programmatic dependent launch, the
streaming tilings), the float32 MMA and the time-major output layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engines.kernels.pdl import launch_kwargs

# Elements of the weight tile one program of the whole-tile kernels (`linear`, the streaming conv) holds in
# registers: 32 KB of bf16 over 4 warps.
LINEAR_TILE = 16384

# Programmatic dependent launch (engines/kernels/pdl.py) for calls of up to this many rows (4 sessions' CFG windows).
# Solve graph on an H200 (`python3 -m engines.profiling.profile_codec --timeline`): batch 1 16.3 -> 15.9 ms with PDL
# alone, batch 4 18.5 -> 18.1, but batch 16 23.9 -> 25.3 ms, so larger calls launch plainly.
PDL_MAX_ROWS = 320


@dataclass(frozen=True)
class StreamTiles:
    """Tilings of the whole-tile kernels at streaming row counts (`linear` and the conv up to their row limits,
    `ln_linear` up to 128 rows, `window_attention`), chosen with `python3 -m engines.profiling.profile_codec --tiles`,
    which times the solve graph per variant: a kernel timed alone favours more programs than a chain of kernels under
    PDL does."""

    ln_linear: tuple[int, int, int] = (16, 64, 4)  # BLOCK_M, BLOCK_N, warps
    linear_m: int = 16  # BLOCK_M of `linear`; BLOCK_N = linear_tile // K (16..64)
    linear_tile: int = LINEAR_TILE
    linear_warps: int = 4
    conv_m: int = 16  # BLOCK_M of the whole-tile conv; BLOCK_N = conv_tile // (taps x channels) (16..64)
    conv_tile: int = LINEAR_TILE
    attention_warps: int = 4

    def __post_init__(self) -> None:
        for name, v in (("ln_linear", self.ln_linear[:2]), ("linear_m", (self.linear_m,)), ("conv_m", (self.conv_m,))):
            if any(x < 16 or x & (x - 1) for x in v):
                raise ValueError(f"StreamTiles.{name} must be powers of two >= 16, got {v}")


STREAM_TILES = StreamTiles()


def launch_for(device: torch.device, rows: int) -> dict:
    """Launch keyword arguments of a codec kernel over `rows` rows: PDL where it measured faster."""
    return launch_kwargs(device, allowed=rows <= PDL_MAX_ROWS)


@triton.jit
def mma(a, b, IEEE: tl.constexpr):
    """a @ b in float32 (IEEE products for float32 operands, like the CPU reference)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


def time_major(nb: int, c: int, t: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [B, C, T] tensor in time-major memory (a transposed view of a dense [B, T, C])."""
    return torch.empty(nb, t, c, device=like.device, dtype=like.dtype).transpose(1, 2)

