"""What the token -> mel flow keeps between chunks (a voice's `PreparedVoice`, a session's `FlowState`, keys that grow
a chunk at a time: `GrowingKeys`), the arguments of its encoder for one chunk (`EncodeInputs`), and the padding of the
encoder's prefix keys (`padded_prefix`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engines.cuda.host_copy import upload

# Prefix keys (prompt + window) are padded to a multiple of this: few distinct shapes, hence few CUDA graphs.
PREFIX_ALIGN = 32
# The fewest keys an answer's encoder keys grow by when their buffer is full (`GrowingKeys`).
GROW_MIN = 32


def padded_prefix(n: int) -> int:
    """Prefix length n (keys) rounded up to a multiple of PREFIX_ALIGN."""
    return -(-n // PREFIX_ALIGN) * PREFIX_ALIGN


@dataclass
class PreparedVoice:
    """Everything about a voice the flow needs, computed once per voice (`FlowModel.prepare_voice`)."""

    n_codes: int
    kv: torch.Tensor  # [layers, 2 (k, v), P, H, dk] encoder keys/values of the prompt
    up_kv: torch.Tensor  # [up_layers, 2, 4P, H, dk]
    mu: torch.Tensor  # [80, 4P]
    mel: torch.Tensor  # [80, 4P]
    spks: torch.Tensor  # [80] projected x-vector


@dataclass
class FlowState:
    """One session's flow state between chunks (no batch dimension)."""

    voice: PreparedVoice
    pre: torch.Tensor  # [2, D] last conv1 outputs of the lookahead layer
    up: torch.Tensor  # [2*ratio, D] last repeated frames before the upsample conv
    codes_done: int = 0
    win_kv: torch.Tensor | None = None  # [layers, 2, <=W, H, dk] this session's latest keys/values
    win_up_kv: torch.Tensor | None = None  # [up_layers, 2, <=W*ratio, H, dk]
    ctx_traj: torch.Tensor | None = None  # [steps, 80, C] x_t of the context frames at every Euler step
    ctx_mu: torch.Tensor | None = None  # [80, C]
    ctx_cond: torch.Tensor | None = None  # [80, C]

    def run_key(self) -> tuple[int, int, int]:
        """States with equal keys have the same prompt keys and window lengths (FlowModel._runs)."""
        return id(self.voice), self.win_kv.shape[2], self.win_up_kv.shape[2]

    def nbytes(self) -> int:
        ts = [self.pre, self.up, self.ctx_traj, self.ctx_mu, self.ctx_cond, self.win_kv, self.win_up_kv]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class GrowingKeys:
    """An answer's encoder keys/values [layers, 2, n, H, dk], n growing by a chunk at a time, in a buffer that grows
    by a quarter (at least GROW_MIN keys) when full: an append copies the chunk, not every key before it."""

    def __init__(self, empty: torch.Tensor) -> None:
        self.buf = empty  # [layers, 2, capacity, H, dk] dense
        self.n = empty.shape[2]

    @property
    def value(self) -> torch.Tensor:
        return self.buf[:, :, :self.n]

    def reserve(self, m: int) -> None:
        """Room for m more keys after those held."""
        if self.n + m > self.buf.shape[2]:
            cap = max(self.n + m, self.buf.shape[2] * 5 // 4, self.buf.shape[2] + GROW_MIN)
            buf = self.buf.new_empty(*self.buf.shape[:2], cap, *self.buf.shape[3:])
            buf[:, :, :self.n] = self.value
            if buf.is_cuda:  # the old buffer may come from another stream's pool (an answer's first job ran on a
                self.buf.record_stream(torch.cuda.current_stream())  # lane): not reused before this copy has run
            self.buf = buf

    def append(self, new: torch.Tensor) -> None:
        """new [layers, 2, m, H, dk] after the keys held."""
        m = new.shape[2]
        self.reserve(m)
        self.buf[:, :, self.n:self.n + m] = new
        self.n += m

    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


def _rows(kv: torch.Tensor) -> tuple[int, int]:
    """A dense [layers, 2, rows, H, dk] buffer's address and (layer, k/v) stride, in elements."""
    if not kv.is_contiguous():
        raise ValueError(f"keys {tuple(kv.shape)} must be dense")
    return kv.data_ptr(), kv.stride(1)


def key_groups(lengths: list[int], row_bytes: int, budget: int) -> list[list[int]]:
    """Rows (indices into `lengths`, each row's earlier keys) in groups whose batch tensor of keys, every row padded
    to its group's longest, stays within `budget` bytes (`row_bytes` a key of one row): shortest first, a group
    taking the next row while it fits. One group when the whole batch fits; a row over the budget alone is a group
    of its own. Padding every row of a round to its longest answer would make one long answer cost each row as much."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (len(groups[-1]) + 1) * lengths[i] * row_bytes <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def key_table(voices: list[torch.Tensor], own: list[GrowingKeys]) -> np.ndarray:
    """[B, 6] int64, where the encoder's attention launch finds each answer's earlier keys: its voice's keys' address,
    (layer, k/v) stride and rows, then its own buffer's."""
    return np.asarray([[*_rows(v), v.shape[2], *_rows(o.buf), o.n] for v, o in zip(voices, own, strict=True)],
                      np.int64).reshape(-1, 6)


def append_table(own: list[GrowingKeys]) -> np.ndarray:
    """[3, B] int64, what the appending launch reads of each answer: its buffer's address, stride and rows held."""
    return np.asarray([[*_rows(o.buf), o.n] for o in own], np.int64).reshape(-1, 3).T.copy()


def gather_keys(voices: list[torch.Tensor], own: list[GrowingKeys], length: int) -> torch.Tensor:
    """The earlier keys of a batch of answers in one tensor [B, layers, 2, length, H, dk] (the CPU's encoder reads
    them so; CUDA's reads them in place: `key_table`): row b holds voices[b] ([layers, 2, P_b, H, dk] dense) then
    own[b]'s keys, then zeros."""
    v0 = voices[0]
    out = v0.new_zeros(len(voices), *v0.shape[:2], length, *v0.shape[3:])
    for b, (v, o) in enumerate(zip(voices, own, strict=True)):
        out[b, :, :, :v.shape[2]] = v
        out[b, :, :, v.shape[2]:v.shape[2] + o.n] = o.value
    return out


def append_keys(own: list[GrowingKeys], new: torch.Tensor) -> None:
    """new [B, layers, 2, m, H, dk] after each answer's keys (own[b] takes new[b]). On CUDA one launch."""
    if not new.is_cuda:
        for b, o in enumerate(own):
            o.append(new[b])
        return
    from engines.kernels.speech_out.flow.key_rows import append_rows

    m = new.shape[3]
    for o in own:
        o.reserve(m)
    append_rows(new.contiguous().flatten(4), upload([append_table(own)], new.device)[0])
    for o in own:
        o.n += m


class EncodeInputs(NamedTuple):
    """The arguments of `FlowModel.encode`, in its order (see there), for one chunk of a batch of states."""

    codes: torch.Tensor
    valid: torch.Tensor
    pre: torch.Tensor
    up: torch.Tensor
    pos: torch.Tensor
    up_pos: torch.Tensor
    X: torch.Tensor
    kpos: torch.Tensor
    kvalid: torch.Tensor
    upX: torch.Tensor
    up_kpos: torch.Tensor
    up_kvalid: torch.Tensor
