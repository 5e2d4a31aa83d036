"""The causal Whisper-VQ trunk and its streaming, cross-session batched forward.

Layout (module names = checkpoint names under `encoder.`): conv1 (k3, causal) -> GELU -> conv2 (k3,
stride 2, causal) -> GELU -> + learned positions -> `num_layers` pre-LN Whisper blocks with causal
self-attention -> average pool x4 -> nearest codebook entry. 100 Hz mel -> 50 Hz -> 12.5 Hz codes.

Every step flattens the new frames of all streams into one token matrix (no padding): the convs run as
one im2col matmul each. The blocks run on the streams' new 50 Hz frames padded to the longest
([streams, max new frames], flattened: padding writes its K/V into the pool's spare slot): projections and
MLPs are one matmul each, attention reads each stream's KV slot (kv_pool.py) in one batched call per
layer, so a step costs the same number of kernel launches at batch 1 and 64. Small steps (a commit) replay
the blocks as CUDA graphs over bucketed shapes instead (graphs.py): eagerly they are ~300 launches for a
few ms of GPU work.

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

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engines.codec.encoder.config import EncoderConfig
from engines.codec.encoder.kv_pool import KVPool
from engines.host_copy import upload

# float32 steps on CUDA run the Triton kernels: attention reading the KV pool in place, GEMMs on tensor cores at
# float32 accuracy (engines/kernels/encoder_attention.py, fp32_gemm.py); "0" keeps SDPA over gathered keys and cuBLAS's
# SGEMM (the A/B of docs/PERF_NOTES.md).
TRITON_KERNELS = os.environ.get("MOSS_ENCODER_TRITON", "1") != "0"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False) -> torch.Tensor:
    """[gelu](x @ weight.T + bias): on CUDA in float32, fp32_gemm (3xTF32 from its row threshold on); else torch."""
    if TRITON_KERNELS and x.is_cuda and x.dtype == torch.float32:
        from engines.kernels import fp32_gemm

        return fp32_gemm.linear(x, weight, bias, gelu)
    y = F.linear(x, weight, bias)
    return F.gelu(y) if gelu else y


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


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of these lengths starts (none for none)."""
    return (np.cumsum(lengths) - lengths).astype(np.int64)


class _Rows:
    """Per stream, the rows of a tensor holding every stream's carried rows (stream by stream), then every stream's
    new rows: a stream's own rows are its carried ones followed by its new ones. Index arithmetic in numpy: a step of
    150 streams built these as Python lists in ~25 ms, holding the GIL the engine loop needs."""

    def __init__(self, carried: np.ndarray, new: np.ndarray) -> None:
        self.carried = carried  # [streams]
        self.lengths = carried + new  # [streams]
        self.c0 = _starts(carried)  # [streams] first carried row
        self.n0 = int(carried.sum()) + _starts(new)  # [streams] first new row

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


def _keep(states: list[TrunkState], name: str, counts: np.ndarray, kept: torch.Tensor,
          none_if_empty: bool = False) -> None:
    """Each stream's carried rows (`counts` of them per stream, stream by stream in `kept`) as views of `kept`; a
    stream with none gets an empty view, or None with `none_if_empty`."""
    start = 0
    for st, n in zip(states, counts.tolist(), strict=True):
        setattr(st, name, None if none_if_empty and not n else kept[start:start + n])
        start += n


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
    """The step's new 50 Hz tokens as the layers see them: `batch` rows (the streams with new tokens, in order, then
    padding rows) of `n_max` tokens each, flattened. A stream's row holds its tokens first; the rest is padding, whose
    K/V go to the pool's spare slot and whose outputs are dropped."""

    dense: torch.Tensor  # [N] each real token's row in the padded layout
    tok_pos: torch.Tensor  # [N] each real token's position in its segment
    kv_slot: torch.Tensor  # [batch * n_max] each layout row's KV slot (padding: the spare)
    kv_pos: torch.Tensor  # [batch * n_max] its KV row (= position in the segment)
    slots: torch.Tensor | slice  # [batch] each row's KV slot (slice when consecutive)
    qpos: torch.Tensor  # [batch, n_max] each query's position: key j is visible iff j <= it
    t_max: int  # keys each row attends over
    padded: bool  # some row of the layout is padding


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
        self.graphs = None  # graphs.StepGraphs once captured (SpeechEncoder.capture_graphs)

    def warm_kernels(self) -> None:
        """Compile the Triton kernels' variants that CUDA-graph capture does not meet (steps of many streams: attention
        without key splits, 16- and 32-query tiles; the GEMM's large-row tiling; the convs' GEMMs), so that no compile
        stalls a step while serving. Every row writes its K/V to the pool's spare slot."""
        if not (self._triton and self.kv.keys):
            return
        cfg, kw = self.cfg, {"device": self.device, "dtype": torch.long}
        for batch, n_max in ((32, 16), (64, 32)):  # 512 and 2048 rows: both GEMM tilings, both query tiles
            rows = batch * n_max
            spare = torch.full((rows,), self.kv.spare, **kw)
            x = torch.zeros(rows, cfg.d_model, device=self.device)
            self.layers(x, spare, torch.zeros(rows, **kw), torch.full((batch,), self.kv.spare, **kw),
                        torch.zeros(batch, n_max, **kw), 16)
            _linear(torch.zeros(rows, self.w1.shape[1], device=self.device), self.w1, self.trunk.conv1.bias, True)
            _linear(torch.zeros(rows, self.w2.shape[1], device=self.device), self.w2, self.trunk.conv2.bias, True)

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
        n1 = np.asarray([m.shape[0] for m in mels], dtype=np.int64)
        if not n1.any():
            return [0] * len(states), torch.zeros(0, cfg.d_model, device=self.device)
        # Host: conv1 (k3, causal) over [2 tail frames + new frames]; conv2 (k3, stride 2, causal; output j uses
        # conv1 outputs 2j-2 .. 2j) over [carried conv1 outputs + new]; pooling x4 over [held outputs + new].
        rows1 = _Rows(np.full(len(states), 2, dtype=np.int64), n1)
        rows2 = _Rows(np.asarray([st.h1_tail.shape[0] for st in states], dtype=np.int64), n1)
        n2 = np.where(rows2.lengths < 3, 0, (rows2.lengths - 3) // 2 + 1)
        held = np.asarray([0 if st.pool_buf is None else st.pool_buf.shape[0] for st in states], dtype=np.int64)
        rows3 = _Rows(held, n2)
        counts = rows3.lengths // k
        rest1, kept1 = rows1.tails(rows1.lengths - 2)
        rest2, kept2 = rows2.tails(2 * n2)
        rest3, kept3 = rows3.tails(counts * k)
        past = [st.pos for st in states]
        active = np.flatnonzero(n2).tolist()
        n_max = int(n2.max())
        t_max = max((past[b] + int(n2[b]) for b in active), default=0)
        # The layers' shapes: exact when eager, a captured graph's bucket when one holds this step.
        sizes = self.graphs.sizes(len(active), n_max, t_max) if self.graphs is not None and active else None
        batch, n_pad, t_pad = sizes or (len(active), n_max, t_max)
        slots = [states[b].slot for b in active]
        # A graph reads its slots from an input; eagerly, consecutive slots are a view of the pool instead of a gather.
        consecutive = bool(slots) and sizes is None and slots == list(range(slots[0], slots[0] + len(slots)))
        idx = upload([rows1.windows(n1, 3, 1), rest1, rows2.windows(n2, 3, 2), rest2, rows3.windows(counts, k, k),
                      rest3, *self._plan_arrays(slots, n2[active], [past[b] for b in active], batch, n_pad,
                                                self.kv.spare)], self.device)
        cols1_t, rest1_t, cols2_t, rest2_t, groups_t, rest3_t, dense, tok_pos, kv_slot, kv_pos, slots_t, qpos = idx
        n1, n2, counts = n1.tolist(), n2.tolist(), counts.tolist()
        for st, n, c in zip(states, n1, n2, strict=True):
            st.mel_in_segment += n
            st.pos += c
        # Device.
        src = torch.cat([st.mel_tail for st in states] + [m for m in mels if m.shape[0]]).to(self.dtype)
        cols = src[cols1_t].transpose(1, 2).reshape(cols1_t.shape[0], -1)  # [N1, n_mels * 3] (unfold's [C, k])
        _keep(states, "mel_tail", kept1, src[rest1_t])
        h1 = _linear(cols, self.w1, self.trunk.conv1.bias, gelu=True)  # [N1, d]
        src = torch.cat([st.h1_tail for st in states] + [h1])
        _keep(states, "h1_tail", kept2, src[rest2_t])
        if not active:
            return [0] * len(states), torch.zeros(0, cfg.d_model, device=self.device)
        plan = _Plan(dense=dense, tok_pos=tok_pos, kv_slot=kv_slot, kv_pos=kv_pos, qpos=qpos, t_max=t_pad,
                     slots=slice(slots[0], slots[0] + len(slots)) if consecutive else slots_t,
                     padded=batch * n_pad != dense.shape[0])
        cols = src[cols2_t].transpose(1, 2).reshape(cols2_t.shape[0], -1)  # [N2, d * 3]
        x = _linear(cols, self.w2, self.trunk.conv2.bias, gelu=True)  # [N2, d]
        x = x + self.trunk.embed_positions(plan.tok_pos)
        if plan.padded:
            x = x.new_zeros(batch * n_pad, cfg.d_model).index_copy_(0, plan.dense, x)  # [batch * n_max, d]
        if sizes is not None:
            x = self.graphs.run(sizes, x, plan.kv_slot, plan.kv_pos, plan.slots, plan.qpos)
        else:
            x = self.layers(x, plan.kv_slot, plan.kv_pos, plan.slots, plan.qpos, plan.t_max)
        if plan.padded:
            x = x[plan.dense]  # [N2, d]
        # Average pool x4: a group closes only when its last 50 Hz frame exists.
        src = torch.cat([st.pool_buf for st in states if st.pool_buf is not None] + [x])
        _keep(states, "pool_buf", kept3, src[rest3_t], none_if_empty=True)
        if not any(counts):
            return counts, torch.zeros(0, cfg.d_model, device=self.device)
        return counts, src[groups_t].float().mean(dim=1)  # [groups, d]

    @staticmethod
    def _plan_arrays(slots: list[int], n: list[int], past: list[int], batch: int, n_max: int, spare: int
                     ) -> list[np.ndarray]:
        """The padded layout's host arrays (see _Plan) for streams with KV `slots`, `n` new tokens each after `past`
        positions, in `batch` rows of `n_max` tokens: dense, tok_pos, kv_slot, kv_pos, slots, qpos."""
        rows = len(slots)
        n_arr = np.asarray(n, dtype=np.int64)
        past_arr = np.asarray(past, dtype=np.int64)
        i = np.arange(n_max, dtype=np.int64)
        real = np.zeros((batch, n_max), dtype=bool)
        real[:rows] = i[None, :] < n_arr[:, None]
        qpos = np.zeros((batch, n_max), dtype=np.int64)
        qpos[:rows] = past_arr[:, None] + i[None, :]  # padding queries of a stream's row look at its keys too
        row_slot = np.full(batch, spare, dtype=np.int64)
        row_slot[:rows] = slots
        kv_slot = np.where(real, row_slot[:, None], spare)
        kv_pos = np.where(real, qpos, 0)
        dense = np.flatnonzero(real)
        return [dense, qpos.ravel()[dense], kv_slot.ravel(), kv_pos.ravel(), row_slot, qpos]

    def layers(self, x: torch.Tensor, kv_slot: torch.Tensor, kv_pos: torch.Tensor, slots: torch.Tensor | slice,
               qpos: torch.Tensor, t_max: int) -> torch.Tensor:
        """The transformer blocks over the padded layout (x [batch * n_max, d], see _Plan); what graphs.StepGraphs
        captures."""
        cfg = self.cfg
        if self._fused_attention:
            # The kernel reads K/V through each row's slot (a consecutive run given as a slice becomes indices) and
            # applies the causal rule from qpos itself.
            if isinstance(slots, slice):
                slots = torch.arange(slots.start, slots.stop, device=x.device)
            mask = None
        else:
            mask = torch.arange(t_max, device=x.device)[None, None, :] <= qpos[:, :, None]  # [batch, n_max, t_max]
            mask = mask[:, None]  # [batch, 1, n_max, t_max]
        for li, layer in enumerate(self.trunk.layers):
            x = x + self._attention(li, layer, x, kv_slot, kv_pos, slots, qpos, t_max, mask)
            h = F.layer_norm(x, (cfg.d_model,), layer.final_layer_norm.weight, layer.final_layer_norm.bias,
                             cfg.layer_norm_eps)
            x = x + _linear(_linear(h, layer.fc1.weight, layer.fc1.bias, gelu=True), layer.fc2.weight, layer.fc2.bias)
        return x

    @property
    def _triton(self) -> bool:
        """float32 on CUDA: the Triton kernels (unless MOSS_ENCODER_TRITON=0)."""
        return self.device.type == "cuda" and self.dtype == torch.float32 and TRITON_KERNELS

    @property
    def _fused_attention(self) -> bool:
        """The Triton attention reading K/V in place (engines/kernels/encoder_attention.py: head_dim a power of two
        >= 16); else SDPA over the gathered keys."""
        hd = self.cfg.head_dim
        return self._triton and hd >= 16 and hd & (hd - 1) == 0

    def _attention(self, li: int, layer: EncoderLayer, x: torch.Tensor, kv_slot: torch.Tensor, kv_pos: torch.Tensor,
                   slots: torch.Tensor | slice, qpos: torch.Tensor, t_max: int, mask: torch.Tensor | None
                   ) -> torch.Tensor:
        cfg = self.cfg
        hds, hd = cfg.num_heads, cfg.head_dim
        batch, n_max = qpos.shape
        h = F.layer_norm(x, (cfg.d_model,), layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias,
                         cfg.layer_norm_eps)
        w, b = self.qkv[li]
        q, k, v = _linear(h, w, b).view(-1, 3, hds, hd).unbind(1)  # each [batch * n_max, heads, head_dim]
        keys, values = self.kv.keys[li], self.kv.values[li]  # [slots, heads, positions, head_dim]
        keys[kv_slot, :, kv_pos] = k
        values[kv_slot, :, kv_pos] = v
        if mask is None:
            from engines.kernels.encoder_attention import encoder_attention

            o = encoder_attention(q, keys, values, slots, qpos, t_max)  # [batch * n_max, d]
            return _linear(o, layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias)
        kb = keys[slots, :, :t_max]  # [batch, heads, t_max, head_dim]
        vb = values[slots, :, :t_max]
        qb = q.view(batch, n_max, hds, hd).transpose(1, 2)  # [batch, heads, n_max, head_dim]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)  # [batch, heads, n_max, head_dim]
        return _linear(o.transpose(1, 2).reshape(-1, cfg.d_model), layer.self_attn.out_proj.weight,
                       layer.self_attn.out_proj.bias)

    def quantize(self, feats: torch.Tensor) -> torch.Tensor:
        """Nearest codebook entry (squared L2; the |x|^2 term is constant per row). [n, d] -> [n] int64."""
        if feats.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        dist = self.codebook_sq[None, :] - 2.0 * feats.float() @ self.codebook.T  # [n, V]
        return dist.argmin(dim=1)
