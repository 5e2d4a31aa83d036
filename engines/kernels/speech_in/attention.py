"""Triton attention of the speech encoder's streaming step, reading K/V in place from its KV pool.

The encoder (engines/speech_in/model.py) attends each stream's few new 50 Hz queries (a step's n_max, 1-32)
to the keys of its segment so far (up to 1500) in float32. The torch path gathers every stream's keys and values
out of the pool (`keys[slots, :, :t_max]`, a copy per layer) and runs SDPA's memory-efficient kernel, whose 64-row
query tiles are mostly padding here and whose programs (streams x heads) each scan all keys: at 32 streams x 20 s it
was 0.62 ms per layer, ~8x its K/V read time (H200, 2026-11-24). Here a program takes one (stream, head, key
split): its queries in one tile, the split's keys read straight from the pool through the stream's slot, an online
softmax in float32 (products at float32 accuracy, or plain TF32 under the encoder's `--encoder-tf32`); a second kernel
merges the splits when there are several. Splits give a step of few streams (a commit) enough programs; the split
count depends only on the launch shape (streams, keys), so a CUDA graph can hold it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.attention_splits import merge_splits, store_split
from engines.kernels.speech_in.fp32_gemm import input_precision

BLOCK_T = 64  # keys per inner iteration
MAX_SPLITS = 16
NUM_WARPS = 4
PROGRAMS_PER_SM = 2  # the split count aims at this many programs per SM (streams x heads x splits)


def num_splits(batch: int, heads: int, t_max: int, device: torch.device) -> int:
    """Key splits per (stream, head): enough programs for PROGRAMS_PER_SM per SM, at most one per BLOCK_T keys and
    at most MAX_SPLITS."""
    want = -(-PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count // (batch * heads))
    return max(1, min(want, MAX_SPLITS, -(-t_max // BLOCK_T)))


# Eager steps hand in slots and query positions as views into one uploaded buffer, at offsets that change with the
# step: specializing on their alignment compiled new variants while serving (a stall of ~0.5 s each).
@triton.jit(do_not_specialize=["N_MAX", "T_MAX", "KEYS_PER_SPLIT"], do_not_specialize_on_alignment=["SLOTS", "QPOS"])
def _encoder_attention_kernel(Q, K, V, SLOTS, QPOS, OUT, PO, PML, s_qr, s_qh, s_ks, s_kh, s_kt, s_vs, s_vh, s_vt,
                              s_or, N_MAX, T_MAX, KEYS_PER_SPLIT, scale, H: tl.constexpr, D: tl.constexpr,
                              BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr,
                              PRECISION: tl.constexpr):
    pid = tl.program_id(0)  # (stream row, head)
    split = tl.program_id(1)
    qblk = tl.program_id(2)
    b = pid // H
    h = pid % H
    slot = tl.load(SLOTS + b)
    rq = qblk * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rd = tl.arange(0, D)
    qm = rq < N_MAX
    qpos = tl.load(QPOS + b * N_MAX + rq, mask=qm, other=-1)  # key j is visible to query i iff j <= qpos[i]
    rows = b * N_MAX + rq
    q = tl.load(Q + rows[:, None] * s_qr + h * s_qh + rd[None, :], mask=qm[:, None], other=0.0)
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, D), tl.float32)
    t0 = split * KEYS_PER_SPLIT
    # No key past the block's last query position is visible: a split wholly beyond it does nothing.
    t_end = tl.minimum(tl.minimum(t0 + KEYS_PER_SPLIT, T_MAX), tl.max(qpos, 0) + 1)
    kbase = K + slot.to(tl.int64) * s_ks + h * s_kh
    vbase = V + slot.to(tl.int64) * s_vs + h * s_vh
    for t in range(t0, t_end, BLOCK_T):
        rt = t + tl.arange(0, BLOCK_T)
        tm = rt < t_end
        k = tl.load(kbase + rt[:, None] * s_kt + rd[None, :], mask=tm[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_Q, BLOCK_T]
        s = tl.where(tm[None, :] & (rt[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vbase + rt[:, None] * s_vt + rd[None, :], mask=tm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    store_split(acc, m_i, l_i, rows, qm, h, split, tl.num_programs(0) // H * N_MAX, OUT, PO, PML, s_or, H, D, SPLIT)


def encoder_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                      qpos: torch.Tensor, t_max: int, tf32: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per stream and head, over the keys j < t_max of the stream's pool slot with
    j <= the query's position. q [batch * n_max, H, D] (rows stream by stream, head_dim dense); keys, values
    [slots, H, positions, D] (the pool's layer tensors); slots [batch] long; qpos [batch, n_max] long.
    Returns [batch * n_max, H * D] float32. A query that sees no key gets zeros. Products on TF32 if `tf32`, else at
    float32 accuracy."""
    rows, heads, d = q.shape
    batch, n_max = qpos.shape
    if rows != batch * n_max or slots.shape != (batch,):
        raise ValueError(f"q has {rows} rows for {batch} streams x {n_max} queries ({tuple(slots.shape)} slots)")
    if q.dtype != torch.float32 or keys.dtype != torch.float32 or values.dtype != torch.float32:
        raise ValueError("encoder_attention is the float32 path")
    if q.stride(2) != 1 or keys.stride(3) != 1 or values.stride(3) != 1 or d & (d - 1) or d < 16:
        raise ValueError("head_dim must be a dense power of two >= 16")
    out = torch.empty(rows, heads * d, device=q.device, dtype=q.dtype)
    if rows == 0:
        return out
    qpos = qpos.contiguous()
    splits = num_splits(batch, heads, t_max, q.device)
    per_split = -(-t_max // splits)
    per_split = -(-per_split // BLOCK_T) * BLOCK_T
    block_q = max(16, min(32, triton.next_power_of_2(n_max)))
    grid = (batch * heads, splits, triton.cdiv(n_max, block_q))
    if splits > 1:
        po = torch.empty(splits, rows, heads, d, device=q.device, dtype=torch.float32)
        pml = torch.empty(splits, rows, heads, 2, device=q.device, dtype=torch.float32)
    else:
        po = pml = out
    _encoder_attention_kernel[grid](
        q, keys, values, slots, qpos, out, po, pml, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), values.stride(0), values.stride(1), values.stride(2), out.stride(0), n_max, t_max, per_split,
        d ** -0.5, H=heads, D=d, BLOCK_Q=block_q, BLOCK_T=BLOCK_T, SPLIT=splits > 1,
        # Unless tf32, products as three TF32 tensor-core products summed in float32 (fp32_gemm.py): 2.5x faster than
        # IEEE products (float32 FMAs) at 32 streams x 1000 keys (121 vs 305 us), as close to SDPA's float32 (~1e-6).
        PRECISION=input_precision(tf32), num_warps=NUM_WARPS)
    if splits > 1:
        merge_splits(po, pml, out, splits, MAX_SPLITS)
    return out
