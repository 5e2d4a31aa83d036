"""The full-context flow's new encoder keys appended to each answer's own buffer, one launch a stack
(engines/speech_out/flow/state.py dispatches; its loop is the CPU path and the reference).

After each round the chunk's new keys and values [B, layers, 2, T, width] go to the end of each answer's buffer, each
at an address of its own: as tensor copies two launches an answer. Here one program copies a block of rows of one
(answer, layer and k/v) pair, the buffers found through a table of their addresses.

A buffer is [layers, 2, rows, width] dense (rows: codes or frames; width = heads * head_dim); its address, its
(layer, k/v) stride and its rows in use are given per answer. Pointers are read as int64 from the device: the
buffers must stay alive until the launch has run (the answers' states hold them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16


@triton.jit(do_not_specialize=["T"])
def _append_kernel(NEW, OPTR, OSTRIDE, OROWS, T, LK: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    b = tl.program_id(0)
    lk = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, WP)
    m = (rows < T)[:, None] & (cols < W)[None, :]
    src = NEW + (b * LK + lk).to(tl.int64) * T * W + rows[:, None] * W + cols[None, :]
    obase = tl.load(OPTR + b).to(tl.pointer_type(NEW.dtype.element_ty)) + lk * tl.load(OSTRIDE + b)
    dst = obase + (tl.load(OROWS + b) + rows)[:, None] * W + cols[None, :]
    tl.store(dst, tl.load(src, mask=m), mask=m)


def append_rows(new: torch.Tensor, table: torch.Tensor) -> None:
    """new [B, layers, 2, T, width] dense; table [3, B] int64: per answer its own buffer's address, (layer, k/v)
    stride and rows in use -> new[b] written after those rows (the buffers have room)."""
    B, layers, two, T, W = new.shape
    if not new.is_contiguous() or table.shape != (3, B):
        raise ValueError(f"keys {tuple(new.shape)} (dense) / table {tuple(table.shape)} disagree")
    if B and T:  # a program per (answer, layer and k/v, block of rows)
        _append_kernel[(B, layers * two, triton.cdiv(T, BLOCK_ROWS))](
            new, *table, T, LK=layers * two, W=W, WP=triton.next_power_of_2(W), BLOCK_R=BLOCK_ROWS)
