"""The causal Whisper-VQ trunk and its streaming, cross-session batched forward.

Layout (module names = checkpoint names under `encoder.`): conv1 (k3, causal) -> GELU -> conv2 (k3,
stride 2, causal) -> GELU -> + learned positions -> `num_layers` pre-LN Whisper blocks with causal
self-attention -> average pool x4 -> nearest codebook entry. 100 Hz mel -> 50 Hz -> 12.5 Hz codes.

Every step flattens the new frames of all streams into one token matrix (no padding): the convs run as
one im2col matmul each. The blocks run on the streams' new 50 Hz frames padded to the longest
([streams, max new frames], flattened: padding writes its K/V into the pool's spare slot): projections and
MLPs are one matmul each, attention reads each stream's KV slot (slot_pool.py) in one batched call per
layer, so a step costs the same number of kernel launches at batch 1 and 64. What a stream carries between
steps (conv and pooling tails, the mel peak) lives in the KV pool's slot-indexed state rows, read and written by
index, so a step is a host plan (numpy index arrays, one upload) and a fixed sequence of kernels over it
(`StreamingRunner.forward`). Small steps (a commit) replay that sequence as one CUDA graph per bucketed shape
(step_graphs.py): eagerly it is ~60 torch calls and ~300 launches for a few ms of GPU work.

Positions restart every `max_source_positions` frames (30 s), as
the reference encodes long audio in independent 30 s windows: at that boundary the stream's conv, KV
and pooling state is reset.

Attention: strictly causal (each 50 Hz frame sees itself and earlier frames). The reference offline
encoder builds a block-causal mask (`quantize_causal_block_size` 200 frames = 4 s: full attention
inside a block); its streaming path keeps a KV cache. Strict causality is what lets a code come out
80 ms after its audio rather than at the end of a 4 s block; with the real weights this is an
approximation of the offline encoder.

The GPU kernels (engines/kernels/speech_in) are imported inside the CUDA branches: they need Triton, which a CPU-only
machine may lack.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engines.cuda.host_copy import upload
from engines.cuda.precision import float32_matmuls
from engines.speech_in.config import EncoderConfig
from engines.speech_in.log_mel import MelFrontend, MelState
from engines.speech_in.slot_pool import KVPool
from engines.speech_in.step_plan import StepSizes, TrunkState, plan_step


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


class StreamingRunner:
    """Runs the frontend and the trunk on the new audio of many streams at once."""

    def __init__(self, trunk: WhisperVQTrunk, frontend: MelFrontend, dtype: torch.dtype, device: torch.device,
                 tf32: bool = False) -> None:
        self.trunk = trunk
        # The blocks' and convs' float32 products on TF32 (a numerics option: ~3x less tensor-core work than float32
        # accuracy; the VQ's distances stay IEEE). Streamed codes still equal whole-utterance codes: on TF32 the
        # GEMMs give a row the same bits at any row count (fp32_gemm.py).
        self.tf32 = tf32
        self.frontend = frontend
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
        self.graphs = None  # step_graphs.StepGraphs once captured (SpeechEncoder.capture_graphs)

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
            self._linear(torch.zeros(rows, self.w1.shape[1], device=self.device), self.w1, self.trunk.conv1.bias, True)
            self._linear(torch.zeros(rows, self.w2.shape[1], device=self.device), self.w2, self.trunk.conv2.bias, True)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False
                ) -> torch.Tensor:
        """[gelu](x @ weight.T + bias): on CUDA in float32, fp32_gemm (3xTF32 from its row threshold on, or TF32 at
        every row count with `tf32`); else torch."""
        if x.is_cuda and x.dtype == torch.float32:
            from engines.kernels.speech_in import fp32_gemm

            return fp32_gemm.linear(x, weight, bias, gelu, self.tf32)
        y = F.linear(x, weight, bias)
        return F.gelu(y) if gelu else y

    def new_state(self, reencode: bool = False) -> TrunkState:
        """A fresh stream state holding a KV slot (`reencode`: a held-back one may serve); give it back with
        `release`."""
        return TrunkState(slot=self.kv.acquire(reencode))

    def release(self, st: TrunkState) -> None:
        self.kv.release(st.slot)

    @staticmethod
    def reset_segment(st: TrunkState) -> None:
        # Rows past `pos` are masked out, so the slot's old rows need no clearing; the carried state starts blank.
        st.pos, st.mel_in_segment, st.h1_len, st.pool_len, st.fresh = 0, 0, 2, 0, True

    @torch.no_grad()
    def run(self, states: list[TrunkState], mels: list[MelState], pcms: list[np.ndarray], limits: np.ndarray
            ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None, bool]:
        """One step: each stream's new samples in, at most `limits` new mel frames each (none may cross its segment
        end). Returns the codes closed per stream, the codes [sum] and their pre-VQ features [sum, d] (float32) on
        the device (None when no frame was new), and whether frames beyond the limits wait for another step.

        Every index of the step follows from row counts known on the host: they are built first (numpy), uploaded in
        one copy, and the device work is `forward` over them, eagerly or as a captured graph of its bucket."""
        mp = self.frontend.plan(mels, pcms, limits)
        if not mp.counts.any():
            return [0] * len(states), None, None, mp.more
        sizes, graphs, idx, counts, n2, h1_len, pool_len = plan_step(self.cfg, self.kv, self.graphs, states, mp)
        # One upload: the samples ride after the indices as their float32 bit patterns, two to an int64.
        samples = np.zeros(sizes.samples, np.float32)
        samples[: mp.samples.size] = mp.samples
        (flat,) = upload([np.concatenate([idx, samples.view(np.int64)])], self.device)
        if graphs is not None:
            codes, feats = graphs.run(sizes, flat)
            feats = feats[: int(counts.sum())].clone()  # the graph's buffers are overwritten by its next replay
            codes = codes[: feats.shape[0]]
        else:
            with float32_matmuls(self.tf32):  # the flow's encoder may launch on TF32 from another thread
                codes, feats = self.forward(flat, sizes)
        for st, n, c, h1, held in zip(states, mp.counts.tolist(), n2.tolist(), h1_len.tolist(), pool_len.tolist(),
                                      strict=True):
            st.mel_in_segment += n
            st.pos += c
            st.h1_len, st.pool_len, st.fresh = h1, held, False
        return counts.tolist(), codes, feats, mp.more

    def blank_inputs(self, sz: StepSizes) -> list[torch.Tensor]:
        """The input (indices, then samples) of a step of padding only: every read of row 0, every write to the
        spare's rows. What a graph is captured on."""
        spare, k = self.kv.spare, self.cfg.pooling_kernel_size
        writes = {"peak_dst": spare, "k1_dst": 2 * spare, "k2_dst": 2 * spare, "kv_slot": spare, "slots": spare,
                  "k3_dst": (k - 1) * spare}
        idx = [np.full(n, writes.get(name, 0), dtype=np.int64) for name, n in sz.parts().items()]
        return [torch.from_numpy(np.concatenate([*idx, np.zeros(sz.samples // 2, np.int64)])).to(self.device)]

    def _no_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(0, dtype=torch.long, device=self.device),
                torch.zeros(0, self.cfg.d_model, device=self.device))

    def forward(self, flat: torch.Tensor, sz: StepSizes) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's device work over its index arrays and samples (`run`, `plan_step`): frontend, conv1, conv2, the
        blocks, pooling, VQ. Returns the codes [groups] and their features [groups, d] (float32). What
        step_graphs.StepGraphs captures."""
        cfg, kv, d, k = self.cfg, self.kv, self.cfg.d_model, self.cfg.pooling_kernel_size
        names = sz.parts()
        *parts, samples = flat.split([*names.values(), sz.samples // 2])
        samples = samples.view(torch.float32)  # [samples]
        i = dict(zip(names, parts, strict=True))
        mel = self.frontend.log_mel(samples, i["f_first"], i["f_cell"], i["peak_src"], i["peak_dst"], i["peak_last"],
                                    kv.peaks, sz.streams + 1, sz.cols)  # [fft_rows, n_mels]
        mel_state = kv.mel_tail.view(-1, cfg.num_mel_bins)
        src = torch.cat([mel_state, mel.to(self.dtype)])  # [state rows + fft_rows, n_mels]
        mel_state[i["k1_dst"]] = src[i["k1_src"]]
        cols = src[i["c1"].view(-1, 3)].transpose(1, 2).reshape(sz.windows, -1)  # [windows, n_mels * 3] (unfold's)
        h1 = self._linear(cols, self.w1, self.trunk.conv1.bias, gelu=True)  # [windows, d]
        h1_state = kv.h1_tail.view(-1, d)
        src = torch.cat([h1_state, h1])  # [state rows + windows, d]
        h1_state[i["k2_dst"]] = src[i["k2_src"]]
        if not sz.tokens:
            return self._no_codes()
        cols = src[i["c2"].view(-1, 3)].transpose(1, 2).reshape(sz.tokens, -1)  # [tokens, d * 3]
        x = self._linear(cols, self.w2, self.trunk.conv2.bias, gelu=True)  # [tokens, d]
        x = x + self.trunk.embed_positions(i["tok_pos"])
        if sz.padded:
            x = torch.cat([x, x.new_zeros(1, d)])[i["lay_src"]]  # [batch * n_max, d]; padding from the zero row
        x = self.layers(x, i["kv_slot"], i["kv_pos"], i["slots"], i["qpos"].view(sz.batch, sz.n_max), sz.t_max)
        if sz.padded:
            x = x[i["dense"]]  # [tokens, d]
        pool_state = kv.pool.view(-1, d)
        src = torch.cat([pool_state, x])  # [state rows + tokens, d]
        pool_state[i["k3_dst"]] = src[i["k3_src"]]
        if not sz.groups:
            return self._no_codes()
        feats = src[i["groups"].view(-1, k)].float().mean(dim=1)  # [groups, d]
        return self.quantize(feats), feats

    def layers(self, x: torch.Tensor, kv_slot: torch.Tensor, kv_pos: torch.Tensor, slots: torch.Tensor,
               qpos: torch.Tensor, t_max: int) -> torch.Tensor:
        """The transformer blocks over the layout (x [batch * n_max, d]; kv_slot, kv_pos [batch * n_max] where each
        token's K/V go; slots [batch] each row's KV slot; qpos [batch, n_max] each query's position)."""
        cfg = self.cfg
        if self._fused_attention:
            mask = None  # the kernel reads K/V through each row's slot and applies the causal rule from qpos itself
        else:
            mask = torch.arange(t_max, device=x.device)[None, None, :] <= qpos[:, :, None]  # [batch, n_max, t_max]
            mask = mask[:, None]  # [batch, 1, n_max, t_max]
        for li, layer in enumerate(self.trunk.layers):
            x = x + self._attention(li, layer, x, kv_slot, kv_pos, slots, qpos, t_max, mask)
            h = F.layer_norm(x, (cfg.d_model,), layer.final_layer_norm.weight, layer.final_layer_norm.bias,
                             cfg.layer_norm_eps)
            x = x + self._linear(self._linear(h, layer.fc1.weight, layer.fc1.bias, gelu=True), layer.fc2.weight,
                                 layer.fc2.bias)
        return x

    @property
    def _triton(self) -> bool:
        """float32 on CUDA: the Triton kernels (attention reading the KV pool in place, GEMMs on tensor cores at
        float32 accuracy: engines/kernels/speech_in/attention.py, fp32_gemm.py); else SDPA over gathered keys and
        torch's GEMMs."""
        return self.device.type == "cuda" and self.dtype == torch.float32

    @property
    def _fused_attention(self) -> bool:
        """The Triton attention reading K/V in place (engines/kernels/speech_in/attention.py: head_dim a power of two
        >= 16); else SDPA over the gathered keys."""
        hd = self.cfg.head_dim
        return self._triton and hd >= 16 and hd & (hd - 1) == 0

    def _attention(self, li: int, layer: EncoderLayer, x: torch.Tensor, kv_slot: torch.Tensor, kv_pos: torch.Tensor,
                   slots: torch.Tensor, qpos: torch.Tensor, t_max: int, mask: torch.Tensor | None
                   ) -> torch.Tensor:
        cfg = self.cfg
        hds, hd = cfg.num_heads, cfg.head_dim
        batch, n_max = qpos.shape
        h = F.layer_norm(x, (cfg.d_model,), layer.self_attn_layer_norm.weight, layer.self_attn_layer_norm.bias,
                         cfg.layer_norm_eps)
        w, b = self.qkv[li]
        q, k, v = self._linear(h, w, b).view(-1, 3, hds, hd).unbind(1)  # each [batch * n_max, heads, head_dim]
        keys, values = self.kv.keys[li], self.kv.values[li]  # [slots, heads, positions, head_dim]
        keys[kv_slot, :, kv_pos] = k
        values[kv_slot, :, kv_pos] = v
        if mask is None:
            from engines.kernels.speech_in.attention import encoder_attention

            o = encoder_attention(q, keys, values, slots, qpos, t_max, self.tf32)  # [batch * n_max, d]
            return self._linear(o, layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias)
        kb = keys[slots, :, :t_max]  # [batch, heads, t_max, head_dim]
        vb = values[slots, :, :t_max]
        qb = q.view(batch, n_max, hds, hd).transpose(1, 2)  # [batch, heads, n_max, head_dim]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)  # [batch, heads, n_max, head_dim]
        return self._linear(o.transpose(1, 2).reshape(-1, cfg.d_model), layer.self_attn.out_proj.weight,
                            layer.self_attn.out_proj.bias)

    def quantize(self, feats: torch.Tensor) -> torch.Tensor:
        """Nearest codebook entry (squared L2; the |x|^2 term is constant per row). [n, d] -> [n] int64."""
        with float32_matmuls(False):  # IEEE whatever the trunk's setting: the argmin is the output
            dist = self.codebook_sq[None, :] - 2.0 * feats.float() @ self.codebook.T  # [n, V]
        return dist.argmin(dim=1)
