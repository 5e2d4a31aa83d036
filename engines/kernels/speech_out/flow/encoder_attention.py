"""The full-context flow encoder's attention, reading each answer's earlier keys where they are (its voice's buffer,
then its own, found through a table of their addresses: flow/state.py `key_table`) instead of from a round's
gathered batch tensor.

A layer's score of query t and key j is (q_t + u) . k_j + (q_t + v) W_pos . sinusoid(t - j), scaled by 1/sqrt(dk)
(conformer.py). The relative part is computed as conformer.AttnContext writes it: a per-query row of D values
(`RelPosSelfAttention._relative_rows`) against a per-key factor that depends only on the key's position, and a key's
position is its index among the answer's keys (the voice's, then the answer's own, then the chunk's new ones). So one
table of those factors by position, shared by every answer, layer and stack, stands in for the batch tensor of them.

One program per (answer, head, block of queries) runs the softmax over the keys online, a block of keys at a time:
the voice's and the answer's earlier keys (every query sees all of them) and the chunk's new ones, under the chunk
mask when the call holds several chunks (an answer's first job). Its shapes do not depend on how many keys an answer
holds, so a round's encoder replays as a CUDA graph whatever the answers' lengths. Pointers are read as int64 from the
table: the buffers must stay alive until the launch has run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_KEYS = 32
# Queries a program takes: all of a steady chunk's (5 codes, 20 frames), so that the key factors, what a program reads
# most of, are read once per (answer, head); 16 at least (tl.dot's smallest M).
MAX_BLOCK_QUERIES = 32
# The relative term's channels in a loop (not unrolled), whose loads the compiler pipelines: unrolled, the loop over
# keys holds every channel block's tiles at once (full size, 16 queries: 47 KB of shared memory unpipelined, 269 KB
# at 3 stages, past an SM's 227 KB); as a loop, 29 KB at 3 stages with 32 queries.


@triton.jit(do_not_specialize=["T", "CW", "LAYER"])
def _attention_kernel(Q, KN, VN, S_B, S_T, ROWS, FACTORS, TABLE, LAYER, T, CW, scale, OUT,
                      H: tl.constexpr, DK: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                      BD: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2) * BQ + tl.arange(0, BQ)  # [BQ] queries
    tm = t < T
    c = tl.arange(0, DK)
    dcol = tl.arange(0, BD)
    ty = OUT.dtype.element_ty
    q = tl.load(Q + b * S_B + t[:, None] * S_T + h * DK + c[None, :], mask=tm[:, None], other=0.0)  # [BQ, DK]
    # The answer's keys: its voice's P rows, then its own N; a layer's keys at (2 LAYER) x stride, values one more.
    row = TABLE + b * 6
    P = tl.load(row + 2)
    N = tl.load(row + 5)
    n_old = P + N
    vstride = tl.load(row + 1)
    ostride = tl.load(row + 4)
    vk = tl.load(row).to(tl.pointer_type(ty)) + 2 * LAYER * vstride + h * DK
    ok = tl.load(row + 3).to(tl.pointer_type(ty)) + 2 * LAYER * ostride + h * DK
    nk = KN + b * S_B + h * DK
    nv = VN + b * S_B + h * DK
    rows = ROWS + ((b * H + h) * T + t)[:, None] * D  # [BQ, 1] each query's relative row
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, DK], tl.float32)
    for j0 in range(0, n_old + T, BK):
        j = j0 + tl.arange(0, BK)  # [BK] key index = key position
        in_v = j < P
        in_o = (j >= P) & (j < n_old)
        in_n = (j >= n_old) & (j < n_old + T)
        # Exactly one of the three loads is unmasked for a real key; the others give zeros.
        k = (tl.load(vk + j[:, None] * DK * H + c[None, :], mask=in_v[:, None], other=0.0)
             + tl.load(ok + (j - P)[:, None] * DK * H + c[None, :], mask=in_o[:, None], other=0.0)
             + tl.load(nk + (j - n_old)[:, None] * S_T + c[None, :], mask=in_n[:, None], other=0.0))  # [BK, DK]
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BQ, BK]
        for d0 in range(0, D, BD):  # the relative term
            r = tl.load(rows + d0 + dcol[None, :], mask=tm[:, None], other=0.0)  # [BQ, BD]
            f = tl.load(FACTORS + j[:, None] * D + d0 + dcol[None, :], mask=(j < n_old + T)[:, None], other=0.0)
            f = f.to(r.dtype)
            s += tl.dot(r, tl.trans(f), input_precision=PREC)
        seen = (j < n_old)[None, :] | (in_n[None, :] & ((j - n_old)[None, :] // CW <= t[:, None] // CW))
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = (tl.load(vk + vstride + j[:, None] * DK * H + c[None, :], mask=in_v[:, None], other=0.0)
             + tl.load(ok + ostride + (j - P)[:, None] * DK * H + c[None, :], mask=in_o[:, None], other=0.0)
             + tl.load(nv + (j - n_old)[:, None] * S_T + c[None, :], mask=in_n[:, None], other=0.0))
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = OUT + ((b * T + t) * H + h)[:, None] * DK + c[None, :]
    tl.store(out, (acc / l_i[:, None]).to(ty), mask=tm[:, None])


def row_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, rows: torch.Tensor,
                  factors: torch.Tensor, table: torch.Tensor, layer: int, chunk: int, tf32: bool) -> torch.Tensor:
    """q (with pos_bias_u added), k_new, v_new [B, T, H, dk] (views of one projection: the same strides, dk
    contiguous); rows [B, H, T, D] dense, each query's relative row; factors [positions, D] dense, the key factor of
    each position (in float16 where the products round to TF32: the same 10-bit mantissa, half the reads); table
    [B, 6] int64 (state.key_table: each answer's voice buffer and its own, [layers, 2, rows, H, dk] dense); `layer`
    the stack's layer these keys are of; `chunk` the new keys' chunk width (a query sees the new keys of its own chunk
    and earlier ones). Returns the attention's output [B, T, H, dk]."""
    B, T, H, dk = q.shape
    D = rows.shape[-1]
    if (k_new.stride() != q.stride() or v_new.stride() != q.stride() or q.stride(3) != 1 or q.stride(2) != dk
            or not rows.is_contiguous() or not factors.is_contiguous() or table.shape != (B, 6)):
        raise ValueError(f"row_attention: q {tuple(q.shape)} / rows {tuple(rows.shape)} / table "
                         f"{tuple(table.shape)} layouts disagree")
    out = q.new_empty(B, T, H, dk)
    bq = min(MAX_BLOCK_QUERIES, max(16, triton.next_power_of_2(T)))
    if B and T:
        _attention_kernel[(B, H, triton.cdiv(T, bq))](
            q, k_new, v_new, q.stride(0), q.stride(1), rows, factors, table, layer, T, chunk, dk ** -0.5, out,
            H=H, DK=dk, D=D, BQ=bq, BK=BLOCK_KEYS, BD=min(D, 64),
            PREC="tf32" if tf32 and q.dtype == torch.float32 else "ieee", num_warps=4, num_stages=3)
    return out
