"""A value as a key/value cache stores it, inside Triton kernels: an fp8 (e4m3) cache saturates at +-FP8_MAX, as
`engines.config.to_cache` does on the torch path. Used by the language model's fused K/V write and by the
full-context flow's page write."""

from __future__ import annotations

import triton
import triton.language as tl

from engines.config import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def cache_value(x, ty: tl.constexpr):
    """x in the cache's element type `ty`."""
    if ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -_FP8_MAX), _FP8_MAX)
    return x.to(ty)
