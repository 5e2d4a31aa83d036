"""The sampler's counter-based noise in one kernel (GPU only; engines/lm/sampler.py dispatches).

The torch path computes the per-row key and the per-candidate exponential noise with ~40 elementwise
int64 ops, each a launch of a few microseconds at decode batch sizes. This kernel does the same integer
hash in int64 (bit-identical) and the same float32 log (libdevice logf, as torch's CUDA log), in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def exp_noise(seed, step, ids, CHANNEL: tl.constexpr):
    """Exp(1) noise of candidate ids for one row's (seed, step) on a channel: row_keys + exponential_noise of
    engines/lm/sampler.py in int64, and torch's float32 log (libdevice logf)."""
    seed = seed.to(tl.int64)
    key = _mix32((step.to(tl.int64) * 2 + CHANNEL) & 0xFFFFFFFF)
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF))
    key = _mix32(key ^ (seed & 0xFFFFFFFF))
    x = _mix32(_mix32(ids.to(tl.int64) & 0xFFFFFFFF) ^ key)
    return -libdevice.log(((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0))


# K and the row stride change with the batch's largest top-k; specializing on them compiled new kernels
# while serving (each a 100-500 ms stall of the engine loop).
@triton.jit(do_not_specialize=["K", "stride_ids"])
def _race_noise_kernel(SEEDS, STEPS, IDS, OUT, K, stride_ids, CHANNEL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    ids = tl.load(IDS + row * stride_ids + offs, mask=mask, other=0)
    tl.store(OUT + row * K + offs, exp_noise(tl.load(SEEDS + row), tl.load(STEPS + row), ids, CHANNEL), mask=mask)


def race_noise(seeds: torch.Tensor, steps: torch.Tensor, channel: int, token_ids: torch.Tensor) -> torch.Tensor:
    """== exponential_noise(row_keys(seeds, steps, channel), token_ids): [B] seeds/steps, [B, K] ids -> [B, K]."""
    b, k = token_ids.shape
    out = torch.empty(b, k, device=token_ids.device, dtype=torch.float32)
    if b and k:
        block = min(1024, triton.next_power_of_2(k))
        _race_noise_kernel[(b, triton.cdiv(k, block))](seeds, steps, token_ids, out, k, token_ids.stride(0),
                                                        CHANNEL=channel, BLOCK=block, num_warps=4)
    return out
