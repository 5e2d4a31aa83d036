"""A value as a key/value cache stores it, inside Triton kernels: an fp8 (e4m3) cache saturates at +-FP8_MAX, as
`engines.config.to_cache` does on the torch path (the language model's fused K/V write and the full-context flow's
page write); and the dtype attention over such a cache runs its dots in, as it reads it back (`fp16_dots`, `kv_tile`:
the language model's paged attention and the flow's)."""

from __future__ import annotations

import torch
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


def fp16_dots(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether attention over this cache runs its dots in fp16: an fp8 (e4m3) cache under a 16-bit query. Every
    e4m3 value is exact in fp16, and so is a bf16 query's element from 2**-14 to 65504 (a query after its RMSNorm
    stays far below the top; smaller elements keep fewer bits, and add next to nothing to a dot of 128); the
    probabilities round to fp16's 11 bits instead of bf16's 8."""
    return cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32


@triton.jit
def kv_tile(x, Q, F16: tl.constexpr):
    """A K or V tile in the dtype of the dots: fp16 over an fp8 cache (one conversion instruction per two values,
    where e4m3 -> bf16 takes several: 5-10% faster at 64-128 sequences, H100), else the query's."""
    if F16:
        return x.to(tl.float16)
    else:
        return x.to(Q.dtype.element_ty)
