"""Attention of the full-context estimator's new chunks over every earlier frame, reading keys and values in place
from its pages (engines/speech_out/flow/pages.py).

The torch path gathers each row's pages into one tensor per block and Euler step (a copy of everything the answer
has said so far, written and read again) and runs SDPA under a mask; that copy is what grows with the answer. Here a
program takes one (row, head, key split, block of queries): each key's page is looked up in the row's table as it is
read, an online softmax in float32 runs over the keys, and `merge_splits` combines the splits when a launch of few
rows has several (enough programs for the GPU; the split count depends only on the launch's shapes, so a CUDA graph
holds it).

Keys, in the order a row reads them: its earlier pages' frames (`n_keys`, whole pages), then the new chunks' real
frames (`n_new`), a query seeing a new frame only in its own chunk or an earlier one (the chunk mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.attention_splits import merge_splits, store_split

BLOCK_Q = 32  # queries per program (a chunk is 20 frames)
BLOCK_T = 64  # keys per inner iteration
MAX_SPLITS = 16
PROGRAMS_PER_SM = 2


def num_splits(programs: int, max_keys: int, device: torch.device) -> int:
    """Key splits per (row, head, query block): enough for PROGRAMS_PER_SM programs per SM, at most one per BLOCK_T
    keys and at most MAX_SPLITS."""
    want = -(-PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count // programs)
    return max(1, min(want, MAX_SPLITS, -(-max_keys // BLOCK_T)))


# Query counts, rows and table widths are not specialized: a voice's prompt of any length, prepared in one pass, runs
# the kernel compiled at start (a compile while serving stalls its caller ~0.5 s).
@triton.jit(do_not_specialize=["F", "B", "MAXP", "KEYS_PER_SPLIT"])
def _paged_kernel(Q, PAGES, TABLE, NKEYS, NNEW, OUT, PO, PML, s_qr, s_qf, s_kv, s_br, s_pg, s_pf, s_tb, s_or, B, MAXP,
                  KEYS_PER_SPLIT, scale, F, FR: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)  # (row, head)
    split = tl.program_id(1)
    qblk = tl.program_id(2)
    r = pid // H
    h = pid % H
    branch = r // B  # rows: the batch's conditional passes, then its unconditional ones
    b = r % B
    n_keys = tl.load(NKEYS + b)
    total = n_keys + tl.load(NNEW + b)
    rq = qblk * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qm = rq < F
    rd = tl.arange(0, D)
    q = tl.load(Q + r * s_qr + rq[:, None] * s_qf + h * D + rd[None, :], mask=qm[:, None], other=0.0)
    q_chunk = rq // FR
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, D), tl.float32)
    base = PAGES + branch * s_br + h * D
    t0 = split * KEYS_PER_SPLIT
    t_end = tl.minimum(t0 + KEYS_PER_SPLIT, total)
    for t in range(t0, t_end, BLOCK_T):
        u = t + tl.arange(0, BLOCK_T)
        um = u < t_end
        old = u < n_keys
        j = u - n_keys  # among the new chunks' frames
        lt = tl.where(old, u, MAXP * FR + j)  # the frame's place in the row's table of pages
        page = tl.load(TABLE + b * s_tb + lt // FR, mask=um, other=0)
        off = page.to(tl.int64) * s_pg + (lt % FR) * s_pf
        k = tl.load(base + off[:, None] + rd[None, :], mask=um[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_Q, BLOCK_T] float32
        vis = um[None, :] & (old[None, :] | ((j // FR)[None, :] <= q_chunk[:, None]))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(base + s_kv + off[:, None] + rd[None, :], mask=um[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    store_split(acc, m_i, l_i, r * F + rq, qm, h, split, tl.num_programs(0) // H * F, OUT, PO, PML, s_or, H, D, SPLIT)


def paged_attention(q: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, n_keys: torch.Tensor,
                    n_new: torch.Tensor, heads: int, frames: int) -> torch.Tensor:
    """q [2B, F, heads * D] (a view is fine: the last dim dense), pages [2 kv, 2 branch, pages, frames, heads * D]
    (one block's), table [B, maxp + c] long (a row's earlier pages, padded, then its c new chunks' pages), n_keys [B]
    long (real frames of the earlier pages: whole pages), n_new [B] long (real frames of the new chunks) ->
    [2B, F, heads * D] in q's dtype. F = c chunks of `frames`."""
    R, Fq, HD = q.shape
    B, slots = table.shape
    D = HD // heads
    if R != 2 * B or pages.shape[-1] != HD or q.stride(2) != 1 or pages.stride(4) != 1:
        raise ValueError(f"q {tuple(q.shape)} / pages {tuple(pages.shape)} / table {tuple(table.shape)} disagree")
    c = -(-Fq // frames)
    maxp = slots - c
    out = torch.empty(R, Fq, HD, device=q.device, dtype=q.dtype)
    qblocks = triton.cdiv(Fq, BLOCK_Q)
    splits = num_splits(R * heads * qblocks, maxp * frames + Fq, q.device)
    per_split = -(-(maxp * frames + Fq) // splits)
    per_split = -(-per_split // BLOCK_T) * BLOCK_T
    if splits > 1:
        po = torch.empty(splits, R * Fq, heads, D, device=q.device, dtype=torch.float32)
        pml = torch.empty(splits, R * Fq, heads, 2, device=q.device, dtype=torch.float32)
    else:
        po = pml = out
    table = table.contiguous()
    _paged_kernel[(R * heads, splits, qblocks)](
        q, pages, table, n_keys, n_new, out, po, pml, q.stride(0), q.stride(1), pages.stride(0), pages.stride(1),
        pages.stride(2), pages.stride(3), table.stride(0), HD, B, maxp, per_split, D ** -0.5, F=Fq, FR=frames,
        H=heads, D=D, BLOCK_Q=BLOCK_Q, BLOCK_T=BLOCK_T, SPLIT=splits > 1, num_warps=4)
    if splits > 1:
        merge_splits(po, pml, out.view(R * Fq, HD), splits, MAX_SPLITS)
    return out
