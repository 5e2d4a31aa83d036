"""A value as a key/value cache stores it, inside Triton kernels: an fp8 (e4m3) cache saturates at +-FP8_MAX, as
`engines.config.to_cache` does on the torch path (the language model's fused K/V write and the full-context flow's
page write); and the dtype attention over such a cache runs its dots in, as it reads it back (`fp16_dots`, `kv_tile`:
the language model's paged attention and the flow's); and how the flow's attention loads a tile of cached rows
(`kv_rows`: fp8 rows read as 32-bit words and converted as loaded). The language model's decode attention loads its
fp8 tiles as fp8 values: read as words it measured 2-6% slower at 16-128 sequences, where it runs at 70-86% of its
copy floor (docs/performance.md, Tried and rejected)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.config import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)
# Inline PTX on a GPU; the Triton interpreter (TRITON_INTERPRET=1, set before this import) runs none
_ASM = tl.constexpr(not triton.knobs.runtime.interpret)


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


@triton.jit
def _e4m3_byte(w, SHIFT: tl.constexpr):
    """The e4m3 value in bits SHIFT .. SHIFT + 8 of each 32-bit word of `w`, as fp16 (the interpreter's conversion)."""
    return ((w >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def kv_rows(base, rows, mask, Q, D: tl.constexpr, F16: tl.constexpr, ALL: tl.constexpr = False):
    """Cached rows at `base` + rows [BLOCK] (each row's first element; a row is D contiguous values), those under
    `mask` [BLOCK] (every one with ALL: no load masked) -> [BLOCK, D] in the dtype of the dots (`kv_tile`), 0 where
    masked.

    Over an fp8 cache (F16) the rows are read as 32-bit words of 4 values, each word converted to fp16 in registers
    as it is loaded (two cvt.rn.f16x2.e4m3x2), so that the tile reaches the dots' operand layout in fp16, through
    shared memory by ldmatrix as 16-bit caches do. Loaded as fp8 values, a tile went to that layout in fp8, a
    values tile assembled from shared memory a byte at a time (its pairs for the products lie along the rows, a row
    apart): the flow's attention took 872 instructions a block of 128 keys where this takes 589, and its launch at
    64 answers 10-11% longer on an H100 (`engines.profiling.attention_sass`, `estimator_attention`). The conversion
    is inline PTX because Triton moves a plain one past the layout change; in the interpreter the same words are
    split by shifts. Rows and `base` must be 4-byte aligned (callers check: `check_word_aligned`)."""
    if F16:
        ptrs = base.to(tl.pointer_type(tl.int32)) + (rows // 4)[:, None] + tl.arange(0, D // 4)[None, :]
        if ALL:
            w = tl.load(ptrs)  # [BLOCK, D // 4]
        else:
            w = tl.load(ptrs, mask=mask[:, None], other=0)
        if _ASM:
            a, b, c, d = tl.inline_asm_elementwise(
                "{ .reg .b16 p0, p1; .reg .b32 r0, r1; mov.b32 {p0, p1}, $4; cvt.rn.f16x2.e4m3x2 r0, p0; "
                "cvt.rn.f16x2.e4m3x2 r1, p1; mov.b32 {$0, $1}, r0; mov.b32 {$2, $3}, r1; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            a, b, c, d = _e4m3_byte(w, 0), _e4m3_byte(w, 8), _e4m3_byte(w, 16), _e4m3_byte(w, 24)
        # join adds a last dim: [w, i, j] of join(join(a, c), join(b, d)) is (a, b, c, d)[2i + j]
        return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (w.shape[0], D))
    cols = tl.arange(0, D)
    if ALL:
        x = tl.load(base + rows[:, None] + cols[None, :])
    else:
        x = tl.load(base + rows[:, None] + cols[None, :], mask=mask[:, None], other=0.0)
    return kv_tile(x, Q, F16)


def check_word_aligned(cache: torch.Tensor, strides: tuple[int, ...], head_dim: int) -> None:
    """ValueError unless `kv_rows` may read this cache's rows as 32-bit words: always for a 16-bit cache; for an fp8
    one, its data, the strides its rows are found by and the head size are multiples of 4 bytes."""
    if cache.element_size() == 1 and (cache.data_ptr() % 4 or head_dim % 4 or any(st % 4 for st in strides)):
        raise ValueError(f"an fp8 cache is read as 32-bit words: head size {head_dim} and strides {strides} must be "
                         "multiples of 4")
