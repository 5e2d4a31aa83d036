"""The host plan of a speech encoder step: what each stream carries between steps (`TrunkState`), the shapes of the
step's device work (`StepSizes`) and its index arrays (`plan_step`), numpy over every stream at once, uploaded in one
copy for `StreamingRunner.forward` (engines/speech_in/model.py) or a captured graph of its bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engines.speech_in.config import EncoderConfig
from engines.speech_in.log_mel import FFT_ROWS, MelPlan
from engines.speech_in.slot_pool import KVPool

if TYPE_CHECKING:
    from engines.speech_in.step_graphs import StepGraphs


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of these lengths starts (none for none)."""
    return (np.cumsum(lengths) - lengths).astype(np.int64)


class _Rows:
    """Per stream, its rows in a source tensor: `carried` rows from c0 on (its state rows), then `new` rows from n0 on.
    Index arithmetic in numpy over every stream at once (as Python lists, ~25 ms a step at 150 streams, holding the
    GIL the engine loop needs)."""

    def __init__(self, carried: np.ndarray, new: np.ndarray, c0: np.ndarray, n0: np.ndarray) -> None:
        self.carried = carried  # [streams]
        self.lengths = carried + new  # [streams]
        self.c0 = c0  # [streams]
        self.n0 = n0  # [streams]

    def _at(self, stream: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The row of position `pos` in the stream's own rows."""
        c = self.carried[stream]
        return np.where(pos < c, self.c0[stream] + pos, self.n0[stream] + pos - c)

    def windows(self, counts: np.ndarray, width: int, stride: int) -> np.ndarray:
        """[sum(counts), width]: each stream's `counts` windows over its rows, `stride` apart."""
        stream = np.repeat(np.arange(len(counts)), counts)  # [windows]
        j = np.arange(stream.size) - np.repeat(_starts(counts), counts)  # each window's number in its stream
        return self._at(stream[:, None], (j * stride)[:, None] + np.arange(width)[None, :])

    def tails(self, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each stream's rows from position `start` on, stream by stream, and how many each stream has."""
        n = self.lengths - start  # [streams]
        stream = np.repeat(np.arange(n.size), n)
        pos = start[stream] + np.arange(stream.size) - np.repeat(_starts(n), n)
        return self._at(stream, pos), n


@dataclass
class TrunkState:
    """One stream's host bookkeeping between steps; its carried rows are in the KV pool's state tensors at `slot`."""

    slot: int  # this stream's rows in the KV pool (keys, values and carried state)
    pos: int = 0  # 50 Hz frames produced in this segment = rows in the KV cache
    mel_in_segment: int = 0
    h1_len: int = 2  # conv1 outputs not yet consumed by conv2 (from index 2*pos - 2 on): 1 or 2
    pool_len: int = 0  # trunk outputs waiting for their pooling group to close (< pooling kernel)
    fresh: bool = True  # its state rows not yet written: read the blank row (zeros)


@dataclass(frozen=True)
class StepSizes:
    """The shapes of a step's device work (`StreamingRunner.forward`): exact for an eager step, a CUDA graph's bucket
    when replayed (step_graphs.py: every index array padded, padding reading harmless rows and writing the spare's)."""

    streams: int  # streams in the step (rows of its per-stream arrays; the peak grid has one more for padding)
    fft_rows: int  # frames through the FFT (the new frames, padded)
    cols: int  # the peak grid's columns: most new frames of a stream
    windows: int  # conv1 outputs (new frames)
    keep1: int  # mel rows kept (2 per stream)
    tokens: int  # conv2 outputs (new 50 Hz tokens)
    keep2: int  # conv1 outputs kept
    batch: int  # rows of the blocks' layout
    n_max: int  # tokens per layout row
    t_max: int  # keys attended
    padded: bool  # the layout is not the tokens themselves (some row holds padding)
    groups: int  # codes closed
    keep3: int  # tokens kept for pooling
    samples: int  # (even: they are uploaded two to an int64)
    pool_kernel: int  # tokens per code

    def parts(self) -> dict[str, int]:
        """The index arrays in the step's one upload, in order, and their sizes (see `plan_step`)."""
        lay = self.batch * self.n_max
        grid_rows = self.streams + 1
        return {"f_first": self.fft_rows, "f_cell": self.fft_rows, "peak_src": grid_rows, "peak_dst": grid_rows,
                "peak_last": grid_rows, "c1": 3 * self.windows, "k1_src": self.keep1, "k1_dst": self.keep1,
                "c2": 3 * self.tokens, "k2_src": self.keep2, "k2_dst": self.keep2, "tok_pos": self.tokens,
                "lay_src": lay if self.padded else 0, "dense": self.tokens if self.padded else 0, "kv_slot": lay,
                "kv_pos": lay, "slots": self.batch, "qpos": lay, "groups": self.pool_kernel * self.groups,
                "k3_src": self.keep3, "k3_dst": self.keep3}


def _state_rows(state: torch.Tensor, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows of `state` ([slots + 2, width, ...] seen as [(slots + 2) * width, ...]) for `counts[b]` carried rows of
    the stream at state row `rows[b]` each, stream by stream."""
    width = state.shape[1]
    return width * np.repeat(rows, counts) + np.arange(int(counts.sum())) - np.repeat(_starts(counts), counts)


def _source(state: torch.Tensor, carried: np.ndarray, new: np.ndarray, base: np.ndarray) -> _Rows:
    """Each stream's rows in [`state` flattened to rows (its carried rows at state row `base`), the step's new rows]."""
    width = state.shape[1]
    return _Rows(carried, new, width * base, state.shape[0] * width + _starts(new))


def _pad(a: np.ndarray, n: int, fill: int | np.ndarray = 0) -> np.ndarray:
    """`a` (1-D or 2-D) with rows of `fill` up to `n` rows."""
    if a.shape[0] == n:
        return a
    out = np.empty((n, *a.shape[1:]), dtype=np.int64)
    out[: a.shape[0]] = a
    out[a.shape[0]:] = fill
    return out


def plan_step(cfg: EncoderConfig, kv: KVPool, graphs: StepGraphs | None, states: list[TrunkState], mp: MelPlan
              ) -> tuple[StepSizes, StepGraphs | None, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The plan of a step of `states` over the frontend's plan `mp` for the runner with this config, KV pool and
    captured graphs (None: none): the step's sizes (a captured graph's bucket when one holds it: then those graphs,
    else None), its index arrays (flat, in StepSizes.parts' order), and per stream the codes it closes, the tokens it
    makes, and the conv1 outputs and tokens it carries to its next step.

    Sources: the frontend's frames index `samples`; conv1, conv2 and the pooling each read one tensor made of a
    state tensor's rows (a stream's carried rows at its slot, or the blank row's before its first step) followed
    by the step's new rows; each writes every stream's new carried rows back to its slot (padding: the spare)."""
    k = cfg.pooling_kernel_size
    B = len(states)
    n1 = mp.counts
    slot = np.asarray([st.slot for st in states], dtype=np.int64)
    fresh = np.asarray([st.fresh for st in states], dtype=bool)
    base = np.where(fresh, kv.blank, slot)  # [B] the state row each stream reads
    h1_len = np.where(fresh, 2, [st.h1_len for st in states]).astype(np.int64)
    pool_len = np.where(fresh, 0, [st.pool_len for st in states]).astype(np.int64)
    past = np.where(fresh, 0, [st.pos for st in states]).astype(np.int64)
    L2 = h1_len + n1
    n2 = np.where(L2 < 3, 0, (L2 - 3) // 2 + 1)
    counts = (pool_len + n2) // k
    # The layout rows: streams with new tokens (eager), or every stream (a graph's bucket).
    active = np.flatnonzero(n2)
    n_max = int(n2.max())
    t_max = int((past + n2)[active].max()) if active.size else 0
    N1, N2 = int(n1.sum()), int(n2.sum())
    bucket = None
    if graphs is not None and N2:
        bucket = graphs.sizes(B, max(n_max, -(-int(n1.max()) // 2)), t_max)
    if bucket is not None:
        sizes = bucket
        rows = np.arange(B)
    else:
        rows = active
        batch = active.size
        # cuFFT builds a plan per batch size: its rows padded to a multiple of FFT_ROWS, a few plans serve every
        # load (a new plan mid-serving stalls the engine loop); padding frames go to the grid's padding row.
        sizes = StepSizes(streams=B, fft_rows=N1 + (-N1 % FFT_ROWS), cols=int(n1.max()), windows=N1, keep1=2 * B,
                          tokens=N2, keep2=int((L2 - 2 * n2).sum()), batch=batch, n_max=n_max, t_max=t_max,
                          padded=batch * n_max != N2, groups=int(counts.sum()),
                          keep3=int(((pool_len + n2) % k).sum()), samples=mp.samples.size + mp.samples.size % 2,
                          pool_kernel=k)
    S = sizes
    trash = S.streams  # the peak grid's padding row
    # Frontend: frame j of stream b starts j hops after the stream's first sample; its cell is (b, j).
    fstream = np.repeat(np.arange(B), n1)
    j = np.arange(N1) - np.repeat(_starts(n1), n1)
    f_first = _pad(mp.starts[fstream] + j * cfg.hop_length, S.fft_rows)
    f_cell = _pad(fstream * S.cols + j, S.fft_rows, trash * S.cols)
    peak_src = _pad(np.where(mp.fresh, kv.blank, slot), S.streams + 1, kv.blank)
    peak_dst = _pad(slot, S.streams + 1, kv.spare)
    peak_last = _pad(np.arange(B) * S.cols + np.maximum(n1 - 1, 0), S.streams + 1, trash * S.cols)
    # conv1 (k3, causal) over [2 carried mel frames + new]; keeps the last 2.
    rows1 = _source(kv.mel_tail, np.full(B, 2, dtype=np.int64), n1, base)
    keep1, n_keep1 = rows1.tails(rows1.lengths - 2)
    c1 = _pad(rows1.windows(n1, 3, 1), S.windows)
    k1_dst = _pad(_state_rows(kv.mel_tail, slot, n_keep1), S.keep1, 2 * kv.spare)
    # conv2 (k3, stride 2, causal; output j uses conv1 outputs 2j-2 .. 2j) over [carried + new conv1 outputs].
    rows2 = _source(kv.h1_tail, h1_len, n1, base)
    keep2, n_keep2 = rows2.tails(2 * n2)
    c2 = _pad(rows2.windows(n2, 3, 2), S.tokens)
    k2_dst = _pad(_state_rows(kv.h1_tail, slot, n_keep2), S.keep2, 2 * kv.spare)
    tstream = np.repeat(np.arange(B), n2)
    t_j = np.arange(N2) - np.repeat(_starts(n2), n2)
    tok_pos = _pad(past[tstream] + t_j, S.tokens)
    # The blocks' layout: row r holds stream rows[r]'s tokens, then padding (K/V to the spare slot).
    row_of = np.full(B, -1, dtype=np.int64)
    row_of[rows] = np.arange(rows.size)
    dense = row_of[tstream] * S.n_max + t_j  # [N2] each token's layout row
    # Padded: each layout row's token (padding: the zero row after them), and each token's layout row.
    none = np.zeros(0, dtype=np.int64)
    lay_src = _scatter(dense, S.batch * S.n_max, S.tokens) if S.padded else none
    dense_pad = _pad(dense, S.tokens) if S.padded else none
    # Pooling x4 over [held tokens + new]: a group closes only when its last 50 Hz frame exists.
    rows3 = _source(kv.pool, pool_len, n2, slot)
    keep3, n_keep3 = rows3.tails(counts * k)
    groups = _pad(rows3.windows(counts, k, k), S.groups)
    k3_dst = _pad(_state_rows(kv.pool, slot, n_keep3), S.keep3, (k - 1) * kv.spare)
    kv_slot, kv_pos, row_slot, qpos = _layout_arrays(slot[rows], n2[rows], past[rows], S.batch, S.n_max, kv.spare)
    arrays = {"f_first": f_first, "f_cell": f_cell, "peak_src": peak_src, "peak_dst": peak_dst,
              "peak_last": peak_last, "c1": c1, "k1_src": _pad(keep1, S.keep1), "k1_dst": k1_dst, "c2": c2,
              "k2_src": _pad(keep2, S.keep2), "k2_dst": k2_dst, "tok_pos": tok_pos, "lay_src": lay_src,
              "dense": dense_pad, "kv_slot": kv_slot, "kv_pos": kv_pos, "slots": row_slot, "qpos": qpos,
              "groups": groups, "k3_src": _pad(keep3, S.keep3), "k3_dst": k3_dst}
    idx = np.concatenate([arrays[name].ravel() for name in S.parts()]).astype(np.int64)
    return S, graphs if bucket is not None else None, idx, counts, n2, n_keep2, n_keep3


def _layout_arrays(slots: np.ndarray, n: np.ndarray, past: np.ndarray, batch: int, n_max: int, spare: int
                   ) -> list[np.ndarray]:
    """The blocks' layout for streams with KV `slots`, `n` new tokens each after `past` positions, in `batch` rows
    of `n_max` tokens: each layout row's KV slot and position, each row's slot and each query's position (key j
    is visible iff j <= it)."""
    rows = slots.size
    i = np.arange(n_max, dtype=np.int64)
    real = np.zeros((batch, n_max), dtype=bool)
    real[:rows] = i[None, :] < n[:, None]
    qpos = np.zeros((batch, n_max), dtype=np.int64)
    qpos[:rows] = past[:, None] + i[None, :]  # padding queries of a stream's row look at its keys too
    row_slot = np.full(batch, spare, dtype=np.int64)
    row_slot[:rows] = slots
    kv_slot = np.where(real, row_slot[:, None], spare)
    kv_pos = np.where(real, qpos, 0)
    return [kv_slot.ravel(), kv_pos.ravel(), row_slot, qpos.ravel()]


def _scatter(dense: np.ndarray, n: int, fill: int) -> np.ndarray:
    """[n]: the inverse of `dense` (layout row -> its token), `fill` where no token lands."""
    out = np.full(n, fill, dtype=np.int64)
    out[dense] = np.arange(dense.size)
    return out
