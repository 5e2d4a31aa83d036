"""What the token -> mel flow keeps between chunks (a voice's `PreparedVoice`, a session's `FlowState`), the arguments
of its encoder for one chunk (`EncodeInputs`), and the padding of the encoder's prefix keys (`padded_prefix`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# Prefix keys (prompt + window) are padded to a multiple of this: few distinct shapes, hence few CUDA graphs.
PREFIX_ALIGN = 32


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
