"""The causal Whisper-VQ trunk and its streaming, cross-session batched forward.

Layout (module names = checkpoint names under `encoder.`): conv1 (k3, causal) -> GELU -> conv2 (k3,
stride 2, causal) -> GELU -> + learned positions -> `num_layers` pre-LN Whisper blocks with causal
self-attention -> average pool x4 -> nearest codebook entry. 100 Hz mel -> 50 Hz -> 12.5 Hz codes.

Every step flattens the new frames of all streams into one token matrix (no padding): the convs run as
one im2col matmul each, the blocks' projections and MLPs as one matmul each; only attention runs per
stream, against that stream's KV cache. Positions restart every `max_source_positions` frames (30 s), as
the reference encodes long audio in independent 30 s windows: at that boundary the stream's conv, KV
and pooling state is reset.

Attention: strictly causal (each 50 Hz frame sees itself and earlier frames). The reference offline
encoder builds a block-causal mask (`quantize_causal_block_size` 200 frames = 4 s: full attention
inside a block); its streaming path keeps a KV cache. Strict causality is what lets a code come out
80 ms after its audio rather than at the end of a 4 s block; with the real weights this is an
approximation of the offline encoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engines.codec.encoder.config import EncoderConfig


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


@dataclass
class TrunkState:
    """One stream's state between steps (everything lives on the encoder's device)."""

    mel_tail: torch.Tensor  # [2, n_mels] last mel frames: conv1's left context
    h1_tail: torch.Tensor  # [k, d] conv1 outputs not yet consumed by conv2, from index 2*pos - 2 on
    pos: int = 0  # 50 Hz frames produced in this segment
    mel_in_segment: int = 0
    kv_len: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [heads, capacity, head_dim]
    values: list[torch.Tensor] = field(default_factory=list)
    pool_buf: torch.Tensor | None = None  # [<pool, d] trunk outputs waiting for their group to close


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

    @property
    def mel_per_segment(self) -> int:
        return 2 * self.cfg.max_source_positions  # conv2 has stride 2

    def new_state(self) -> TrunkState:
        cfg = self.cfg
        return TrunkState(
            mel_tail=torch.zeros(2, cfg.num_mel_bins, dtype=self.dtype, device=self.device),
            h1_tail=torch.zeros(2, cfg.d_model, dtype=self.dtype, device=self.device),
        )

    def reset_segment(self, st: TrunkState) -> None:
        fresh = self.new_state()
        st.mel_tail, st.h1_tail, st.pos, st.mel_in_segment = fresh.mel_tail, fresh.h1_tail, 0, 0
        st.kv_len, st.keys, st.values, st.pool_buf = 0, [], [], None

    @torch.no_grad()
    def run(self, states: list[TrunkState], mels: list[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        """Consume each stream's new mel frames (none may cross its segment end).

        Returns the number of codes closed per stream and their pre-VQ features [sum, d] (float32).
        """
        cfg = self.cfg
        # conv1 (k3, causal) as im2col over each stream's [left context + new frames].
        cols, n1 = [], []
        for st, m in zip(states, mels, strict=True):
            x = torch.cat([st.mel_tail, m.to(self.dtype)])  # [2 + n, n_mels]
            st.mel_tail = x[-2:]
            st.mel_in_segment += m.shape[0]
            n1.append(m.shape[0])
            if m.shape[0]:
                cols.append(x.unfold(0, 3, 1).reshape(m.shape[0], -1))  # [n, n_mels * 3]
        if not cols:
            return [0] * len(states), torch.zeros(0, cfg.d_model, device=self.device)
        h1 = F.gelu(F.linear(torch.cat(cols), self.w1, self.trunk.conv1.bias))  # [N1, d]
        # conv2 (k3, stride 2, causal): output j uses conv1 outputs 2j-2 .. 2j.
        cols, n2, pos = [], [], []
        start = 0
        for st, n in zip(states, n1, strict=True):
            y = torch.cat([st.h1_tail, h1[start:start + n]])  # [k + n, d]
            start += n
            c = 0 if y.shape[0] < 3 else (y.shape[0] - 3) // 2 + 1
            if c:
                cols.append(y.unfold(0, 3, 2)[:c].reshape(c, -1))  # [c, d * 3]
            st.h1_tail = y[2 * c:]
            n2.append(c)
            pos.append(torch.arange(st.pos, st.pos + c, device=self.device))
            st.pos += c
        counts = [0] * len(states)
        if not cols:
            return counts, torch.zeros(0, cfg.d_model, device=self.device)
        x = F.gelu(F.linear(torch.cat(cols), self.w2, self.trunk.conv2.bias))  # [N2, d]
        x = x + self.trunk.embed_positions(torch.cat(pos))
        for li, layer in enumerate(self.trunk.layers):
            x = x + self._attention(li, layer, states, n2, x)
            h = F.layer_norm(x, (cfg.d_model,), layer.final_layer_norm.weight, layer.final_layer_norm.bias,
                             cfg.layer_norm_eps)
            x = x + layer.fc2(F.gelu(layer.fc1(h)))
        # Average pool x4: a group closes only when its last 50 Hz frame exists.
        pooled, start = [], 0
        k = cfg.pooling_kernel_size
        for i, (st, c) in enumerate(zip(states, n2, strict=True)):
            y = x[start:start + c]
            start += c
            if st.pool_buf is not None:
                y = torch.cat([st.pool_buf, y])
            g = y.shape[0] // k
            if g:
                pooled.append(y[:g * k].float().reshape(g, k, -1).mean(dim=1))  # [g, d]
            st.pool_buf = y[g * k:] if y.shape[0] > g * k else None
            counts[i] = g
        if not pooled:
            return counts, torch.zeros(0, cfg.d_model, device=self.device)
        return counts, torch.cat(pooled)

    def _attention(self, li: int, layer: EncoderLayer, states: list[TrunkState], n2: list[int],
                   x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        hds, hd = cfg.num_heads, cfg.head_dim
        h = F.layer_norm(x, (cfg.d_model,), layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias,
                         cfg.layer_norm_eps)
        w, b = self.qkv[li]
        qkv = F.linear(h, w, b).view(-1, 3, hds, hd)  # [N2, 3, heads, head_dim]
        outs, start = [], 0
        for st, n in zip(states, n2, strict=True):
            if n == 0:
                continue
            q, k, v = qkv[start:start + n].permute(1, 2, 0, 3).unbind(0)  # each [heads, n, head_dim]
            start += n
            past = st.kv_len  # updated once the last layer has appended
            keys, values = self._append_kv(st, li, k, v, past)
            total = past + n
            qpos = torch.arange(past, total, device=self.device)
            mask = torch.arange(total, device=self.device)[None, :] <= qpos[:, None]  # [n, total] causal
            o = F.scaled_dot_product_attention(q[None], keys[None, :, :total], values[None, :, :total],
                                               attn_mask=mask[None, None])  # [1, heads, n, head_dim]
            outs.append(o[0].permute(1, 0, 2).reshape(n, cfg.d_model))
            if li == len(self.trunk.layers) - 1:
                st.kv_len = total
        return layer.self_attn.out_proj(torch.cat(outs))

    def _append_kv(self, st: TrunkState, li: int, k: torch.Tensor, v: torch.Tensor,
                   past: int) -> tuple[torch.Tensor, torch.Tensor]:
        need = past + k.shape[1]
        if li >= len(st.keys):
            cap = max(need, 64)
            st.keys.append(k.new_empty(k.shape[0], cap, k.shape[2]))
            st.values.append(v.new_empty(v.shape[0], cap, v.shape[2]))
        elif st.keys[li].shape[1] < need:
            # Grow by doubling (capped at a segment) so appends stay amortised O(1).
            cap = min(max(need, 2 * st.keys[li].shape[1]), self.cfg.max_source_positions)
            for buf in (st.keys, st.values):
                old = buf[li]
                grown = old.new_empty(old.shape[0], cap, old.shape[2])
                grown[:, :past] = old[:, :past]
                buf[li] = grown
        st.keys[li][:, past:need] = k
        st.values[li][:, past:need] = v
        return st.keys[li], st.values[li]

    def quantize(self, feats: torch.Tensor) -> torch.Tensor:
        """Nearest codebook entry (squared L2; the |x|^2 term is constant per row). [n, d] -> [n] int64."""
        if feats.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        dist = self.codebook_sq[None, :] - 2.0 * feats.float() @ self.codebook.T  # [n, V]
        return dist.argmin(dim=1)
