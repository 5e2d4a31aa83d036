"""Merging the partial softmax attentions of key splits (flash-decoding): attention kernels that give a few rows
enough programs by splitting each row's keys write, per split, the unnormalized output and its running max and sum
(`store_split`, their epilogue); `merge_splits` combines them. Shared by the speech encoder's and the codec
estimator's paged attention."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_split(acc, m_i, l_i, rows, qm, h, split, n_rows, OUT, PO, PML, s_or, H: tl.constexpr, D: tl.constexpr,
                SPLIT: tl.constexpr):
    """The epilogue of an attention program over one split of a head's keys: with SPLIT, its unnormalized output
    (acc [BLOCK_Q, D] float32) and running (max, sum) per query as `merge_splits` reads them, rows `rows` of n_rows;
    else the normalized output into OUT (rows strided by s_or). Queries off `qm` are not stored."""
    rd = tl.arange(0, D)
    if SPLIT:
        pbase = (split * n_rows + rows) * H + h
        tl.store(PO + pbase[:, None] * D + rd[None, :], acc, mask=qm[:, None])
        tl.store(PML + pbase * 2, m_i, mask=qm)
        tl.store(PML + pbase * 2 + 1, l_i, mask=qm)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(OUT + rows[:, None] * s_or + h * D + rd[None, :], out, mask=qm[:, None])


# The split count is a runtime value and row counts are not specialized: one compiled merge kernel serves every call
# (a compile while serving stalls its caller ~0.5 s).
@triton.jit(do_not_specialize=["n_rows", "SPLITS"])
def _merge_kernel(PO, PML, OUT, n_rows, s_or, SPLITS, H: tl.constexpr, D: tl.constexpr, SPLITS_P: tl.constexpr):
    pid = tl.program_id(0)  # (row, head)
    r = pid // H
    h = pid % H
    rs = tl.arange(0, SPLITS_P)
    rd = tl.arange(0, D)
    sm = rs < SPLITS
    pbase = (rs * n_rows + r) * H + h
    m = tl.load(PML + pbase * 2, mask=sm, other=float("-inf"))
    l_s = tl.load(PML + pbase * 2 + 1, mask=sm, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(sm & (m != float("-inf")), tl.exp(m - mx), 0.0)  # [SPLITS_P]
    den = tl.sum(l_s * w, 0)
    acc = tl.load(PO + pbase[:, None] * D + rd[None, :], mask=sm[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(OUT + r * s_or + h * D + rd, out)


def merge_splits(po: torch.Tensor, pml: torch.Tensor, out: torch.Tensor, splits: int, max_splits: int) -> None:
    """po [splits, rows, H, D] float32 unnormalized outputs, pml [splits, rows, H, 2] float32 (max, sum) -> out
    [rows, H * D] (any float dtype, rows strided by out.stride(0)), normalized over every split. A row with no key in
    any split gets zeros. max_splits: a power of two >= splits (compiled once per value)."""
    rows, heads, d = po.shape[1:]
    _merge_kernel[(rows * heads,)](po, pml, out, rows, out.stride(0), splits, H=heads, D=d, SPLITS_P=max_splits,
                                   num_warps=2)
