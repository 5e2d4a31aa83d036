"""The causal Whisper-VQ trunk and its streaming, cross-session batched forward.

Layout (module names = checkpoint names under `encoder.`): conv1 (k3, causal) -> GELU -> conv2 (k3,
stride 2, causal) -> GELU -> + learned positions -> `num_layers` pre-LN Whisper blocks with causal
self-attention -> average pool x4 -> nearest codebook entry. 100 Hz mel -> 50 Hz -> 12.5 Hz codes.

Every step flattens the new frames of all streams into one token matrix (no padding): the convs run as
one im2col matmul each, the blocks' projections and MLPs as one matmul each. Attention pads only the
queries ([streams, max new frames]) and reads each stream's KV slot (kv_pool.py) with one batched call
per layer, so a step costs the same number of kernel launches at batch 1 and 64.

Positions restart every `max_source_positions` frames (30 s), as
the reference encodes long audio in independent 30 s windows: at that boundary the stream's conv, KV
and pooling state is reset.

Attention: strictly causal (each 50 Hz frame sees itself and earlier frames). The reference offline
encoder builds a block-causal mask (`quantize_causal_block_size` 200 frames = 4 s: full attention
inside a block); its streaming path keeps a KV cache. Strict causality is what lets a code come out
80 ms after its audio rather than at the end of a 4 s block; with the real weights this is an
approximation of the offline encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engines.codec.encoder.config import EncoderConfig
from engines.codec.encoder.kv_pool import KVPool
from engines.host_copy import upload


class SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)  # Whisper's key projection has no bias
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


class WhisperVQTrunk(nn.Module):
    """Weights only; the forward lives in `StreamingRunner` because it needs per-stream state."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.d_model)


def _stream_rows(carried: list[int], new: list[int]) -> list[list[int]]:
    """Rows of a tensor holding every stream's carried rows (stream by stream), then every stream's new rows:
    per stream, the indices of its carried rows followed by its new ones."""
    out, c0, n0 = [], 0, sum(carried)
    for c, n in zip(carried, new, strict=True):
        out.append(list(range(c0, c0 + c)) + list(range(n0, n0 + n)))
        c0, n0 = c0 + c, n0 + n
    return out


def _windows(rows: list[list[int]], counts: list[int], width: int, stride: int) -> np.ndarray:
    """[sum(counts), width]: each stream's `counts` windows over its rows, `stride` apart."""
    out = [r[j * stride:j * stride + width] for r, c in zip(rows, counts, strict=True) for j in range(c)]
    return np.asarray(out, dtype=np.int64).reshape(-1, width)


def _flat(rows: list[list[int]]) -> np.ndarray:
    return np.asarray([i for r in rows for i in r], dtype=np.int64)


def _keep(states: list[TrunkState], name: str, rows: list[list[int]], kept: torch.Tensor,
          none_if_empty: bool = False) -> None:
    """Each stream's carried rows (`rows` gathered into `kept`, stream by stream) as views of `kept`; a stream
    with none gets an empty view, or None with `none_if_empty`."""
    start = 0
    for st, r in zip(states, rows, strict=True):
        setattr(st, name, None if none_if_empty and not r else kept[start:start + len(r)])
        start += len(r)


@dataclass
class TrunkState:
    """One stream's state between steps (everything lives on the encoder's device)."""

    slot: int  # this stream's rows in the KV pool
    mel_tail: torch.Tensor  # [2, n_mels] last mel frames: conv1's left context
    h1_tail: torch.Tensor  # [k, d] conv1 outputs not yet consumed by conv2, from index 2*pos - 2 on
    pos: int = 0  # 50 Hz frames produced in this segment = rows in the KV cache
    mel_in_segment: int = 0
    pool_buf: torch.Tensor | None = None  # [<pool, d] trunk outputs waiting for their group to close


@dataclass
class _Plan:
    """Where each new token of a step goes: its stream row b, index i within the stream, cache row."""

    tok_b: torch.Tensor  # [N]
    tok_i: torch.Tensor  # [N]
    tok_slot: torch.Tensor  # [N]
    tok_pos: torch.Tensor  # [N] position in the segment (= KV row)
    slots: torch.Tensor | slice  # [B] KV slots of the streams with new tokens (slice when consecutive)
    mask: torch.Tensor  # [B, 1, n_max, t_max] causal: key j visible to query i iff j <= past_b + i
    batch: int
    n_max: int
    t_max: int


class StreamingRunner:
    """Runs the trunk on the new mel frames of many streams at once."""

    def __init__(self, trunk: WhisperVQTrunk, dtype: torch.dtype, device: torch.device) -> None:
        self.trunk = trunk
        self.cfg = cfg = trunk.cfg
        self.dtype = dtype
        self.device = device
        t = trunk
        self.w1 = t.conv1.weight.reshape(cfg.d_model, -1)  # [d, n_mels * 3], matches unfold's [C, k] order
        self.w2 = t.conv2.weight.reshape(cfg.d_model, -1)  # [d, d * 3]
        self.qkv = []
        for layer in t.layers:
            a = layer.self_attn
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # [3d, d]
            b = torch.cat([a.q_proj.bias, torch.zeros_like(a.q_proj.bias), a.v_proj.bias])  # [3d]
            self.qkv.append((w, b))
        # VQ in float32 whatever the trunk dtype: the argmin is the output, keep it stable.
        self.codebook = t.codebook.weight.float()  # [V, d]
        self.codebook_sq = self.codebook.square().sum(dim=1)  # [V]
        self.kv = KVPool(cfg, dtype, device)

    @property
    def mel_per_segment(self) -> int:
        return 2 * self.cfg.max_source_positions  # conv2 has stride 2

    def new_state(self) -> TrunkState:
        """A fresh stream state holding a KV slot; give it back with `release`."""
        cfg = self.cfg
        return TrunkState(
            slot=self.kv.acquire(),
            mel_tail=torch.zeros(2, cfg.num_mel_bins, dtype=self.dtype, device=self.device),
            h1_tail=torch.zeros(2, cfg.d_model, dtype=self.dtype, device=self.device),
        )

    def release(self, st: TrunkState) -> None:
        self.kv.release(st.slot)

    def reset_segment(self, st: TrunkState) -> None:
        # Rows past `pos` are masked out, so the slot's old rows need no clearing.
        st.mel_tail = torch.zeros_like(st.mel_tail)
        st.h1_tail = torch.zeros(2, self.cfg.d_model, dtype=self.dtype, device=self.device)
        st.pos, st.mel_in_segment, st.pool_buf = 0, 0, None

    @torch.no_grad()
    def run(self, states: list[TrunkState], mels: list[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        """Consume each stream's new mel frames (none may cross its segment end).

        Returns the number of codes closed per stream and their pre-VQ features [sum, d] (float32).
        Each conv's (and the pooling's) input rows of all streams, their carried tails then the new rows, are
        one tensor gathered by indices; every index of the step follows from row counts known on the host, so
        they are built first and uploaded in one copy. The kernels of a step do not grow with its streams."""
        cfg, k = self.cfg, self.cfg.pooling_kernel_size
        n1 = [int(m.shape[0]) for m in mels]
        if not any(n1):
            return [0] * len(states), torch.zeros(0, cfg.d_model, device=self.device)
        # Host: conv1 (k3, causal) over [2 tail frames + new frames]; conv2 (k3, stride 2, causal; output j uses
        # conv1 outputs 2j-2 .. 2j) over [carried conv1 outputs + new]; pooling x4 over [held outputs + new].
        rows1 = _stream_rows([2] * len(states), n1)
        rows2 = _stream_rows([int(st.h1_tail.shape[0]) for st in states], n1)
        n2 = [0 if len(r) < 3 else (len(r) - 3) // 2 + 1 for r in rows2]
        held = [0 if st.pool_buf is None else int(st.pool_buf.shape[0]) for st in states]
        rows3 = _stream_rows(held, n2)
        counts = [len(r) // k for r in rows3]
        rest2 = [r[2 * c:] for r, c in zip(rows2, n2, strict=True)]
        rest3 = [r[c * k:] for r, c in zip(rows3, counts, strict=True)]
        rest1 = [r[-2:] for r in rows1]
        past = [st.pos for st in states]
        active = [b for b, n in enumerate(n2) if n]
        slots = [states[b].slot for b in active]
        n_max = max((n2[b] for b in active), default=0)
        idx = upload([_windows(rows1, n1, 3, 1), _flat(rest1), _windows(rows2, n2, 3, 2), _flat(rest2),
                      _windows(rows3, counts, k, k), _flat(rest3),
                      *self._plan_arrays(states, n2, past, active, slots, n_max)], self.device)
        cols1_t, rest1_t, cols2_t, rest2_t, groups_t, rest3_t, tok_b, tok_i, tok_slot, tok_pos, slots_t, qpos = idx
        for st, n, c in zip(states, n1, n2, strict=True):
            st.mel_in_segment += n
            st.pos += c
        # Device.
        src = torch.cat([st.mel_tail for st in states] + [m for m in mels if m.shape[0]]).to(self.dtype)
        cols = src[cols1_t].transpose(1, 2).reshape(cols1_t.shape[0], -1)  # [N1, n_mels * 3] (unfold's [C, k])
        _keep(states, "mel_tail", rest1, src[rest1_t])
        h1 = F.gelu(F.linear(cols, self.w1, self.trunk.conv1.bias))  # [N1, d]
        src = torch.cat([st.h1_tail for st in states] + [h1])
        _keep(states, "h1_tail", rest2, src[rest2_t])
        if not active:
            return [0] * len(states), torch.zeros(0, cfg.d_model, device=self.device)
        t_max = max(past[b] + n2[b] for b in active)
        mask = torch.arange(t_max, device=self.device)[None, None, :] <= qpos[:, :, None]  # [B, n_max, t_max]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        plan = _Plan(tok_b=tok_b, tok_i=tok_i, tok_slot=tok_slot, tok_pos=tok_pos,
                     slots=slice(slots[0], slots[0] + len(slots)) if consecutive else slots_t,
                     mask=mask[:, None], batch=len(active), n_max=n_max, t_max=t_max)
        cols = src[cols2_t].transpose(1, 2).reshape(cols2_t.shape[0], -1)  # [N2, d * 3]
        x = F.gelu(F.linear(cols, self.w2, self.trunk.conv2.bias))  # [N2, d]
        x = x + self.trunk.embed_positions(plan.tok_pos)
        for li, layer in enumerate(self.trunk.layers):
            x = x + self._attention(li, layer, plan, x)
            h = F.layer_norm(x, (cfg.d_model,), layer.final_layer_norm.weight, layer.final_layer_norm.bias,
                             cfg.layer_norm_eps)
            x = x + layer.fc2(F.gelu(layer.fc1(h)))
        # Average pool x4: a group closes only when its last 50 Hz frame exists.
        src = torch.cat([st.pool_buf for st in states if st.pool_buf is not None] + [x])
        _keep(states, "pool_buf", rest3, src[rest3_t], none_if_empty=True)
        if not any(counts):
            return counts, torch.zeros(0, cfg.d_model, device=self.device)
        return counts, src[groups_t].float().mean(dim=1)  # [groups, d]

    @staticmethod
    def _plan_arrays(states: list[TrunkState], n2: list[int], past: list[int], active: list[int],
                     slots: list[int], n_max: int) -> list[np.ndarray]:
        """Where each new 50 Hz token goes: stream row b, index i within the stream, KV slot, position; the
        active streams' slots; each query's position [B, n_max] (the causal mask is key pos <= it)."""
        tok_b, tok_i, tok_slot, tok_pos = [], [], [], []
        for row, b in enumerate(active):
            n = n2[b]
            tok_b += [row] * n
            tok_i += range(n)
            tok_slot += [states[b].slot] * n
            tok_pos += range(past[b], past[b] + n)
        qpos = np.asarray([past[b] for b in active], dtype=np.int64)[:, None] + np.arange(n_max)[None, :]
        return [np.asarray(a, dtype=np.int64) for a in (tok_b, tok_i, tok_slot, tok_pos, slots)] + [qpos]

    def _attention(self, li: int, layer: EncoderLayer, plan: _Plan, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        hds, hd = cfg.num_heads, cfg.head_dim
        h = F.layer_norm(x, (cfg.d_model,), layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias,
                         cfg.layer_norm_eps)
        w, b = self.qkv[li]
        q, k, v = F.linear(h, w, b).view(-1, 3, hds, hd).unbind(1)  # each [N, heads, head_dim]
        keys, values = self.kv.keys[li], self.kv.values[li]  # [slots, heads, positions, head_dim]
        keys[plan.tok_slot, :, plan.tok_pos] = k
        values[plan.tok_slot, :, plan.tok_pos] = v
        kb = keys[plan.slots, :, :plan.t_max]  # [B, heads, t_max, head_dim]
        vb = values[plan.slots, :, :plan.t_max]
        qb = q.new_zeros(plan.batch, plan.n_max, hds, hd)
        qb[plan.tok_b, plan.tok_i] = q
        o = F.scaled_dot_product_attention(qb.transpose(1, 2), kb, vb, attn_mask=plan.mask)  # [B, heads, n_max, hd]
        o = o.transpose(1, 2)[plan.tok_b, plan.tok_i]  # [N, heads, head_dim]
        return layer.self_attn.out_proj(o.reshape(-1, cfg.d_model))

    def quantize(self, feats: torch.Tensor) -> torch.Tensor:
        """Nearest codebook entry (squared L2; the |x|^2 term is constant per row). [n, d] -> [n] int64."""
        if feats.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        dist = self.codebook_sq[None, :] - 2.0 * feats.float() @ self.codebook.T  # [n, V]
        return dist.argmin(dim=1)
