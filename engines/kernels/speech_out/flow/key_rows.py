"""The full-context flow's encoder keys between each answer's own buffer and a round's batch tensor, one launch each
way (engines/speech_out/flow/state.py dispatches; its loops are the CPU path and the reference).

Every round, each answer's earlier keys (its voice's, then its own) go into one zero-padded batch tensor the encoder
reads, and after it the chunk's new keys go back to each answer's buffer. As tensor copies that is about four
launches an answer and a zero fill of the whole batch tensor, each answer's buffer at an address of its own. Here
one program copies a block of rows of one (answer, layer and k/v) pair, the answer's buffers found through a table
of their addresses: one launch gathers a stack, one appends to it.

A buffer is [layers, 2, rows, width] dense (rows: codes or frames; width = heads * head_dim); its address, its
(layer, k/v) stride and its rows in use are given per answer. Pointers are read as int64 from the device: the
buffers must stay alive until the launch has run (the answers' states hold them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16


@triton.jit(do_not_specialize=["L"])
def _gather_kernel(OUT, VPTR, VSTRIDE, VROWS, OPTR, OSTRIDE, OROWS, L, LK: tl.constexpr, W: tl.constexpr,
                   WP: tl.constexpr, BLOCK_R: tl.constexpr):
    b = tl.program_id(0)
    lk = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, WP)
    cm = cols < W
    p = tl.load(VROWS + b)
    n = tl.load(OROWS + b)
    vbase = tl.load(VPTR + b).to(tl.pointer_type(OUT.dtype.element_ty)) + lk * tl.load(VSTRIDE + b)
    obase = tl.load(OPTR + b).to(tl.pointer_type(OUT.dtype.element_ty)) + lk * tl.load(OSTRIDE + b)
    in_v = rows < p
    in_o = (rows >= p) & (rows < p + n)
    v = tl.load(vbase + rows[:, None] * W + cols[None, :], mask=in_v[:, None] & cm[None, :], other=0.0)
    o = tl.load(obase + (rows - p)[:, None] * W + cols[None, :], mask=in_o[:, None] & cm[None, :], other=0.0)
    out = OUT + (b * LK + lk).to(tl.int64) * L * W + rows[:, None] * W + cols[None, :]
    tl.store(out, tl.where(in_v[:, None], v, o), mask=(rows < L)[:, None] & cm[None, :])


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


def _launch(kernel, keys: torch.Tensor, table: torch.Tensor, fields: int) -> None:
    """A program per (answer, layer and k/v, block of rows) of keys [B, layers, 2, rows, width] dense."""
    B, layers, two, R, W = keys.shape
    if not keys.is_contiguous() or table.shape != (fields, B):
        raise ValueError(f"keys {tuple(keys.shape)} (dense) / table {tuple(table.shape)} disagree")
    if B and R:
        kernel[(B, layers * two, triton.cdiv(R, BLOCK_ROWS))](
            keys, *table, R, LK=layers * two, W=W, WP=triton.next_power_of_2(W), BLOCK_R=BLOCK_ROWS)


def gather_rows(out: torch.Tensor, table: torch.Tensor) -> None:
    """out [B, layers, 2, L, width] dense; table [6, B] int64 on out's device: per answer its voice buffer's address,
    (layer, k/v) stride and rows, then its own buffer's -> out[b] holds the voice's rows, then its own, then zeros."""
    _launch(_gather_kernel, out, table, 6)


def append_rows(new: torch.Tensor, table: torch.Tensor) -> None:
    """new [B, layers, 2, T, width] dense; table [3, B] int64: per answer its own buffer's address, (layer, k/v)
    stride and rows in use -> new[b] written after those rows (the buffers have room)."""
    _launch(_append_kernel, new, table, 3)
