"""One channel's top-k sampling in two launches (GPU only; engines/lm/sampler.py dispatches).

The torch path (mask, repetition penalty, temperature, staged top-k, softmax, cumsum, top-p, noise, argmax,
gather) was ~35 launches after every decode step: ~0.14 ms of GPU time plus the gaps between them at batch 1, on
a step of ~5 ms (2026-11-23). Here:

1. `_candidates_kernel`, grid (rows, slices): a slice of the row's logits through the mask, the penalty and the
   temperature, then its top KP as packed int64 keys (value's order bits above, index below);
2. `_pick_kernel`, grid (rows,): the top KP of all slices' candidates, then top-k, softmax, top-p, the
   exponential race with the counter-based noise of engines/kernels/lm/sampling.py, and greedy.

Packing the index below the value makes equal values rank lowest index first, as torch.argmax picks. The
arithmetic is the torch path's (float32, IEEE division, libdevice exp/log); the reductions (softmax sum, top-p
cumsum) run in another order, so a probability can differ in its last bits, which changes a sample only when two
candidates' scores tie to those bits (tests/gpu: tokens equal to the torch path on random rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engines.kernels.lm.sampling import exp_noise

MAX_TOP_K = 64  # wider top-k (or top-k off) takes the torch path


@triton.jit
def _pack(x, idx):
    """float32 values and int32 indices -> int64 keys ordered by value, then by lower index."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0, which torch ranks equal
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


@triton.jit
def _unpack(key):
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 2147483647 - (key & 0x7FFFFFFF).to(tl.int32)


# V, the strides and the number of slices follow the vocabulary and the batch: no specialization on them, so a
# new batch never compiles a kernel while serving. Nor on the alignment of the per-row columns: they are views into
# the step's staged upload whose offsets move with the batch size (a 12-session load test compiled _pick_kernel
# mid-serving, a 2.1 s stall); each program reads one word of each, so alignment buys nothing.
@triton.jit(do_not_specialize=["V", "stride_l", "stride_seen", "MASK_FROM", "GATE_ID"],
            do_not_specialize_on_alignment=["SLOTS", "PENALTY", "TEMP", "GREEDY", "STEPS", "MIN_NEW"])
def _candidates_kernel(LOGITS, SEEN, SLOTS, PENALTY, TEMP, GREEDY, STEPS, MIN_NEW, CAND, V, stride_l, stride_seen,
                       MASK_FROM, GATE_ID, W: tl.constexpr, KP: tl.constexpr, GATED: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    offs = s * W + tl.arange(0, W)
    ok = offs < V
    x = tl.load(LOGITS + row.to(tl.int64) * stride_l + offs, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(offs >= MASK_FROM, float("-inf"), x)  # ids never sampled (MASK_FROM = V: none)
    if GATED:  # the gated id (end of speech) waits for min_new_tokens generated rows
        x = tl.where((offs == GATE_ID) & (tl.load(STEPS + row) < tl.load(MIN_NEW + row)), float("-inf"), x)
    slot = tl.load(SLOTS + row).to(tl.int64)
    seen = tl.load(SEEN + slot * stride_seen + offs, mask=ok, other=0) != 0
    p = tl.load(PENALTY + row)
    x = tl.where(seen, tl.where(x > 0, x / p, x * p), x)
    temp = tl.where(tl.load(GREEDY + row) != 0, 1.0, tl.load(TEMP + row))
    keys = _pack(x / temp, offs)
    top = tl.sort(tl.topk(keys, KP), descending=True)  # [KP]
    tl.store(CAND + (row * tl.num_programs(1) + s) * KP + tl.arange(0, KP), top)


@triton.jit(do_not_specialize=["NC", "stride_out"],
            do_not_specialize_on_alignment=["TOP_K", "TOP_P", "GREEDY", "SEEDS", "STEPS", "OUT"])
def _pick_kernel(CAND, TOP_K, TOP_P, GREEDY, SEEDS, STEPS, OUT, NC, stride_out, KP: tl.constexpr,
                 CP: tl.constexpr, CHANNEL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CP)
    pad = _pack(tl.full([CP], float("-inf"), tl.float32), tl.full([CP], 2147483647, tl.int32))
    keys = tl.load(CAND + row * NC + offs, mask=offs < NC, other=0)
    keys = tl.where(offs < NC, keys, pad)
    top = tl.sort(tl.topk(keys, KP), descending=True)  # [KP], the row's candidates best first
    vals, ids = _unpack(top)
    pos = tl.arange(0, KP)
    vals = tl.where(pos < tl.load(TOP_K + row), vals, float("-inf"))
    e = libdevice.exp(vals - tl.max(vals, 0))
    probs = e / tl.sum(e, 0)
    mass_above = tl.cumsum(probs, 0) - probs  # top-p: the first candidate always stays
    probs = tl.where(mass_above >= tl.load(TOP_P + row), 0.0, probs)
    noise = exp_noise(tl.load(SEEDS + row), tl.load(STEPS + row), ids, CHANNEL)
    choice = tl.argmax(probs / noise, 0, tie_break_left=True)
    sampled = tl.sum(tl.where(pos == choice, ids, 0), 0)
    greedy_id = tl.sum(tl.where(pos == 0, ids, 0), 0)  # top of the penalized logits (temperature 1 when greedy)
    token = tl.where(tl.load(GREEDY + row) != 0, greedy_id, sampled)
    tl.store(OUT + row * stride_out, token.to(tl.int64))


def supported(logits: torch.Tensor, max_top_k: int) -> bool:
    """float32 logits on CUDA, and every row's top-k on and at most MAX_TOP_K."""
    return logits.is_cuda and logits.dim() == 2 and logits.dtype == torch.float32 and 0 < max_top_k <= MAX_TOP_K


def topk_sample(logits: torch.Tensor, seen: torch.Tensor, slots: torch.Tensor, temperature: torch.Tensor,
                top_p: torch.Tensor, top_k: torch.Tensor, penalty: torch.Tensor, greedy: torch.Tensor,
                seeds: torch.Tensor, steps: torch.Tensor, channel: int, max_top_k: int, mask_from: int | None = None,
                gate_id: int | None = None, min_new: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Tokens [B] int64 of logits [B, V] float32 (left intact) as engines.lm.sampler.sample_channel draws them.

    seen [slots, V] bool (row i uses seen[slots[i]]); per-row [B] temperature, top_p, penalty (float32), top_k
    (int64, all > 0, max_top_k their largest), greedy (bool or int). Ids >= mask_from are never drawn; gate_id
    only once steps >= min_new. out: a [B] int64 view to write into (e.g. a column of the step's pairs)."""
    b, v = logits.shape
    if out is None:
        out = torch.empty(b, dtype=torch.long, device=logits.device)
    if b == 0:
        return out
    kp = max(16, triton.next_power_of_2(max_top_k))
    w = min(4096, max(1024, triton.next_power_of_2(triton.cdiv(v, 32))))  # <= 32 slices
    n_slices = triton.cdiv(v, w)
    cand = torch.empty(b, n_slices * kp, dtype=torch.long, device=logits.device)
    gated = gate_id is not None
    steps_arg, min_new_arg = (steps, min_new) if gated else (slots, slots)
    _candidates_kernel[(b, n_slices)](
        logits, seen, slots, penalty, temperature, greedy, steps_arg, min_new_arg, cand, v, logits.stride(0),
        seen.stride(0), v if mask_from is None else mask_from, gate_id if gated else -1, W=w, KP=kp, GATED=gated,
        num_warps=8 if w > 1024 else 4)
    _pick_kernel[(b,)](cand, top_k, top_p, greedy, seeds, steps, out, n_slices * kp, out.stride(0), KP=kp,
                       CP=triton.next_power_of_2(n_slices * kp), CHANNEL=channel, num_warps=4)
    return out
