"""Attention of the full-context estimator's new chunks over every earlier frame, reading keys and values in place
from its pages (engines/speech_out/flow/pages.py).

The torch path gathers each row's pages into one tensor per block and Euler step (a copy of everything the answer
has said so far, written and read again) and runs SDPA under a mask; that copy is what grows with the answer. Here a
program takes one (row, head, key split, block of queries): each key's page is looked up in the row's table as it is
read, an online softmax in float32 runs over the keys, and `merge_splits` combines the splits when a launch of few
rows has several (enough programs for the GPU). The split count depends only on the rows and queries, and each row's
keys are shared among the splits by the row's own length, read on the device: the table's width (padding) costs no
work, so one CUDA graph of a batch serves answers and voices of any length.

`write_pages` puts the new chunks' keys and values into their pages first (one program per frame: a row of keys
and one of values copied whole), which the attention then reads as it reads earlier frames.

Pages are in the estimator's dtype or in fp8 (e4m3, saturated at +-448: `--decoder-cache-dtype fp8`); fp8 keys and
values are read as 32-bit words and converted to fp16 in registers as they are loaded (`cache_value.kv_rows`), and
the products run in fp16 (`cache_value.fp16_dots`, as the language model's paged attention). Half the bytes, but
not a faster launch than bf16 pages: the loop's instructions, not its bytes, hold both (docs/performance.md, The
full-context flow).

Keys, in the order a row reads them: its earlier pages' frames (`n_keys`, whole pages), then the new chunks' real
frames (`n_new`), a query seeing a new frame only in its own chunk or an earlier one (the chunk mask). Three loops
read them, so that each mask costs only where it applies: the earlier pages' whole blocks of BLOCK_T keys with no
mask, their partial last block under the length mask, the new frames in blocks of BLOCK_NEW under the chunk mask.
Half the instructions per earlier key of one masked loop over all, and fewer registers (3 programs an SM, not 2):
9% faster a launch at 64 answers over 42 pages on an H200 (docs/performance.md, The full-context flow).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.attention_splits import merge_splits, store_split
from engines.kernels.cache_value import cache_value, check_word_aligned, fp16_dots, kv_rows

BLOCK_Q = 32  # queries per program (a chunk is 20 frames)
BLOCK_T = 128  # keys per inner iteration over the earlier pages
BLOCK_NEW = 32  # keys per iteration over the new chunks' frames (a chunk is 20)
MAX_SPLITS = 16
PROGRAMS_PER_SM = 2
NUM_WARPS = 4
# The pipeliner gives 3 stages one shared-memory buffer a block of keys (the loads wait out their latency); 5 or 7
# give 2 or 3 at 2 programs an SM, measured no faster on an H100 (docs/performance.md, Tried and rejected).
NUM_STAGES = 3


def num_splits(programs: int, device: torch.device) -> int:
    """Key splits per (row, head, query block): enough for PROGRAMS_PER_SM programs per SM, at most MAX_SPLITS."""
    want = -(-PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count // programs)
    return max(1, min(want, MAX_SPLITS))


LOG2E = 1.4426950408889634  # the softmax runs in base 2: exp2 is one instruction, exp a multiply and an exp2


@triton.jit
def _keys(q, m_i, l_i, acc, Q, base, table, s_kv, s_pg, s_pf, t, t_end, n_keys, MAXP, q_chunk, qk_scale,
          FR: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, NEW: tl.constexpr, F16: tl.constexpr,
          WHOLE: tl.constexpr = False):
    """Keys t .. t + BLOCK of a row (those before t_end) into the online softmax (base 2). Earlier pages' keys (NEW
    false) are seen by every query; a new chunk's frame only by queries of its chunk or a later one. WHOLE: every key
    of the block is before t_end, so no load is masked."""
    u = t + tl.arange(0, BLOCK)
    um = u < t_end
    if NEW:
        j = u - n_keys  # among the new chunks' frames
        lt = MAXP * FR + j  # the frame's place in the row's table of pages
    else:
        lt = u
    if WHOLE:
        page = tl.load(table + lt // FR)
    else:
        page = tl.load(table + lt // FR, mask=um, other=0)
    off = page.to(tl.int64) * s_pg + (lt % FR) * s_pf
    k = kv_rows(base, off, um, Q, D, F16, WHOLE)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_Q, BLOCK] float32, base 2
    if NEW:
        s = tl.where(um[None, :] & ((j // FR)[None, :] <= q_chunk[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that has seen no key yet
    else:
        # every query sees every earlier key: the max is finite from the first block on
        if not WHOLE:
            s = tl.where(um[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = kv_rows(base + s_kv, off, um, Q, D, F16, WHOLE)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# Query counts, rows and table widths are not specialized: a voice's prompt of any length, prepared in one pass, runs
# the kernel compiled at start (a compile while serving stalls its caller ~0.5 s).
@triton.jit(do_not_specialize=["F", "B", "MAXP"])
def _paged_kernel(Q, PAGES, TABLE, NKEYS, NNEW, OUT, PO, PML, s_qr, s_qf, s_kv, s_br, s_pg, s_pf, s_tb, s_or, B, MAXP,
                  qk_scale, F, FR: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_NEW: tl.constexpr, SPLIT: tl.constexpr, F16: tl.constexpr):
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
    if F16:
        q = q.to(tl.float16)  # dots in fp16 over fp8 pages
    q_chunk = rq // FR
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, D), tl.float32)
    base = PAGES + branch * s_br + h * D
    table = TABLE + b * s_tb
    per_split = tl.cdiv(tl.cdiv(total, tl.num_programs(1)), BLOCK_T) * BLOCK_T  # this row's keys, split evenly
    t0 = split * per_split
    t_end = tl.minimum(t0 + per_split, total)
    # Three loops, so that only the last needs the chunk mask and only the last two any mask: the earlier pages'
    # whole blocks, their partial last block, then the new chunks' frames in smaller blocks (a chunk is 20).
    old_end = tl.minimum(t_end, n_keys)
    whole_end = t0 + tl.maximum(old_end - t0, 0) // BLOCK_T * BLOCK_T
    for t in range(t0, whole_end, BLOCK_T):
        m_i, l_i, acc = _keys(q, m_i, l_i, acc, Q, base, table, s_kv, s_pg, s_pf, t, old_end, n_keys, MAXP, q_chunk,
                              qk_scale, FR, D, BLOCK_T, False, F16, True)
    for t in range(whole_end, old_end, BLOCK_T):
        m_i, l_i, acc = _keys(q, m_i, l_i, acc, Q, base, table, s_kv, s_pg, s_pf, t, old_end, n_keys, MAXP, q_chunk,
                              qk_scale, FR, D, BLOCK_T, False, F16)
    for t in range(tl.maximum(t0, n_keys), t_end, BLOCK_NEW):
        m_i, l_i, acc = _keys(q, m_i, l_i, acc, Q, base, table, s_kv, s_pg, s_pf, t, t_end, n_keys, MAXP, q_chunk,
                              qk_scale, FR, D, BLOCK_NEW, True, F16)
    m_i = m_i * 0.6931471805599453  # (ln 2) merge_splits reads the max in base e
    store_split(acc, m_i, l_i, r * F + rq, qm, h, split, tl.num_programs(0) // H * F, OUT, PO, PML, s_or, H, D, SPLIT)


def paged_attention(q: torch.Tensor, pages: torch.Tensor, table: torch.Tensor, n_keys: torch.Tensor,
                    n_new: torch.Tensor, heads: int, frames: int) -> torch.Tensor:
    """q [2B, F, heads * D] (a view is fine: the last dim dense), pages [2 kv, 2 branch, pages, frames, heads * D]
    (one block's; q's dtype or fp8), table [B, maxp + c] long (a row's earlier pages, padded, then its c new chunks'
    pages), n_keys [B] long (real frames of the earlier pages: whole pages), n_new [B] long (real frames of the new
    chunks) -> [2B, F, heads * D] in q's dtype. F = c chunks of `frames`."""
    R, Fq, HD = q.shape
    B, slots = table.shape
    D = HD // heads
    if R != 2 * B or pages.shape[-1] != HD or q.stride(2) != 1 or pages.stride(4) != 1:
        raise ValueError(f"q {tuple(q.shape)} / pages {tuple(pages.shape)} / table {tuple(table.shape)} disagree")
    check_word_aligned(pages, pages.stride()[:4], D)
    c = -(-Fq // frames)
    maxp = slots - c
    out = torch.empty(R, Fq, HD, device=q.device, dtype=q.dtype)
    qblocks = triton.cdiv(Fq, BLOCK_Q)
    splits = num_splits(R * heads * qblocks, q.device)
    if splits > 1:
        po = torch.empty(splits, R * Fq, heads, D, device=q.device, dtype=torch.float32)
        pml = torch.empty(splits, R * Fq, heads, 2, device=q.device, dtype=torch.float32)
    else:
        po = pml = out
    table = table.contiguous()
    _paged_kernel[(R * heads, splits, qblocks)](
        q, pages, table, n_keys, n_new, out, po, pml, q.stride(0), q.stride(1), pages.stride(0), pages.stride(1),
        pages.stride(2), pages.stride(3), table.stride(0), HD, B, maxp, D ** -0.5 * LOG2E, F=Fq, FR=frames, H=heads,
        D=D, BLOCK_Q=BLOCK_Q, BLOCK_T=BLOCK_T, BLOCK_NEW=BLOCK_NEW, SPLIT=splits > 1, F16=fp16_dots(q, pages),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if splits > 1:
        merge_splits(po, pml, out.view(R * Fq, HD), splits, MAX_SPLITS)
    return out


@triton.jit(do_not_specialize=["B"])
def _write_kernel(QKV, PAGES, NEW_PAGE, s_qr, s_qf, s_kv, s_br, s_pg, s_pf, s_np, B, FR: tl.constexpr,
                  HD: tl.constexpr, HD_P: tl.constexpr):
    r = tl.program_id(0)  # rows: the batch's conditional passes, then its unconditional ones
    f = tl.program_id(1)
    branch = r // B
    b = r % B
    page = tl.load(NEW_PAGE + b * s_np + f // FR).to(tl.int64)
    rd = tl.arange(0, HD_P)
    m = rd < HD
    src = QKV + r.to(tl.int64) * s_qr + f * s_qf + HD + rd  # q/k/v: the keys after the queries, then the values
    dst = PAGES + branch * s_br + page * s_pg + (f % FR) * s_pf + rd
    tl.store(dst, cache_value(tl.load(src, mask=m), PAGES.dtype.element_ty), mask=m)
    tl.store(dst + s_kv, cache_value(tl.load(src + HD, mask=m), PAGES.dtype.element_ty), mask=m)


def write_pages(qkv: torch.Tensor, pages: torch.Tensor, new_page: torch.Tensor) -> None:
    """The keys and values of qkv [2B, F, 3 * heads * D] (F = c chunks of frames, rows branch-major; q, k, v along
    the last dim) into pages [2 kv, 2 branch, pages, frames, heads * D] (one block's) at new_page [B, c] long: chunk
    i of row b's branch goes to page new_page[b, i]."""
    R, Fq, HD3 = qkv.shape
    B, c = new_page.shape
    HD, frames = HD3 // 3, pages.shape[3]
    if R != 2 * B or Fq != c * frames or pages.shape[-1] != HD or qkv.stride(2) != 1 or pages.stride(4) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} / pages {tuple(pages.shape)} / new_page {tuple(new_page.shape)} "
                         "disagree")
    _write_kernel[(R, Fq)](qkv, pages, new_page, qkv.stride(0), qkv.stride(1), pages.stride(0), pages.stride(1),
                           pages.stride(2), pages.stride(3), new_page.stride(0), B, FR=frames, HD=HD,
                           HD_P=triton.next_power_of_2(HD), num_warps=4)
