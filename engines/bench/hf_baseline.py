"""Baseline: the model run the way the HF reference code runs it, on the same weights.

Eager PyTorch, separate q/k/v and gate/up matmuls, a contiguous per-layer KV cache, torch SDPA,
both heads on every row, no CUDA graphs. Benchmarks print our engine next to this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.lm.model.moss import MossSpeechModel
from engines.lm.model.rope import apply_rope, rope_cos_sin


class HFStyleModel:
    def __init__(self, model: MossSpeechModel, batch: int, max_len: int) -> None:
        self.m = model
        c = model.config
        self.c = c
        shape = (batch, c.num_key_value_heads, max_len, c.head_dim)
        self.k = [torch.randn(shape, device=model.device, dtype=model.dtype) for _ in model.layers]
        self.v = [torch.randn(shape, device=model.device, dtype=model.dtype) for _ in model.layers]

    def _layer(self, i: int, x: torch.Tensor, cos, sin, start: int) -> torch.Tensor:
        lay, c = self.m.layers[i], self.c
        b, t, _ = x.shape
        qs, ks = lay.q_size, lay.kv_size
        w = lay.qkv_proj.weight
        h = lay.input_layernorm(x)
        q = F.linear(h, w[:qs]).view(b, t, c.num_attention_heads, c.head_dim)
        k = F.linear(h, w[qs:qs + ks]).view(b, t, c.num_key_value_heads, c.head_dim)
        v = F.linear(h, w[qs + ks:]).view(b, t, c.num_key_value_heads, c.head_dim)
        q = apply_rope(lay.q_norm(q).flatten(0, 1), cos, sin).view(b, t, -1, c.head_dim).transpose(1, 2)
        k = apply_rope(lay.k_norm(k).flatten(0, 1), cos, sin).view(b, t, -1, c.head_dim).transpose(1, 2)
        self.k[i][:, :, start:start + t] = k
        self.v[i][:, :, start:start + t] = v.transpose(1, 2)
        end = start + t
        o = F.scaled_dot_product_attention(q, self.k[i][:, :, :end], self.v[i][:, :, :end],
                                           is_causal=t > 1, enable_gqa=True)
        x = x + lay.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = lay.post_attention_layernorm(x)
        gu = lay.gate_up_proj.weight
        x = x + lay.down_proj(F.silu(F.linear(h, gu[:lay.ffn])) * F.linear(h, gu[lay.ffn:]))
        return x

    @torch.inference_mode()
    def forward(self, rows: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [B, T, 2] at positions start..start+T-1 -> (text logits, audio logits) for every row."""
        b, t, _ = rows.shape
        x = self.m.embed(rows.flatten(0, 1)).view(b, t, -1)
        pos = torch.arange(start, start + t, device=rows.device).repeat(b)
        cos, sin = rope_cos_sin(pos, self.m.inv_freq, x.dtype)
        shared, text_tail, audio_tail = self.m.tail_layer_ranges()
        for i in shared:
            x = self._layer(i, x, cos, sin, start)
        h_t, h_a = x, x
        for i in text_tail:
            h_t = self._layer(i, h_t, cos, sin, start)
        for i in audio_tail:
            h_a = self._layer(i, h_a, cos, sin, start)
        return self.m.text_logits(self.m.text_norm(h_t)), self.m.audio_logits(self.m.audio_norm(h_a))
