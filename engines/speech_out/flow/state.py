"""What the token -> mel flow keeps between chunks (a voice's `PreparedVoice`, a session's `FlowState`, keys that grow
a chunk at a time: `GrowingKeys`), the arguments of its encoder for one chunk (`EncodeInputs`), and the padding of the
encoder's prefix keys (`padded_prefix`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

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
        self.buf = empty  # [layers, 2, capacity, H, dk]
        self.n = empty.shape[2]

    @property
    def value(self) -> torch.Tensor:
        return self.buf[:, :, :self.n]

    def append(self, new: torch.Tensor) -> None:
        """new [layers, 2, m, H, dk] after the keys held."""
        m = new.shape[2]
        if self.n + m > self.buf.shape[2]:
            cap = max(self.n + m, self.buf.shape[2] * 5 // 4, self.buf.shape[2] + GROW_MIN)
            buf = self.buf.new_empty(*self.buf.shape[:2], cap, *self.buf.shape[3:])
            buf[:, :, :self.n] = self.value
            self.buf = buf
        self.buf[:, :, self.n:self.n + m] = new
        self.n += m

    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


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
