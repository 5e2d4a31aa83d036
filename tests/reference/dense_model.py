"""Dense reference of MOSS-Speech: the test oracle.

Written from the published model's description alone, independent of engines/lm/model: no paging, no fused weights,
the whole
sequence recomputed every call with a full causal mask. Reads the checkpoint's own key names.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.config import ModelConfig
from engines.tokens import MODALITY_PAD


class DenseMossSpeech:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 kv_fp8: bool = False):
        """kv_fp8: attention reads keys and values rounded to e4m3 (saturated at +-448), as an fp8 KV cache holds
        them."""
        self.config = config
        self.dtype = dtype
        self.kv_fp8 = kv_fp8
        self.w = {k: v.to(dtype) for k, v in weights.items()}

    def _cached(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kv_fp8:
            return x
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same rounding order as the release: normalise in float32, back to the working dtype, times weight.
        xf = x.to(torch.float32)
        xf = xf / torch.sqrt((xf * xf).mean(dim=-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """x: [heads, L, head_dim] rotated by position 0..L-1 (neox halves)."""
        d = self.config.head_dim
        # float32 on the CPU, as the release computes its rotary frequencies.
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2).to(torch.float32) / d))
        ang = torch.outer(torch.arange(length, dtype=torch.float32), inv)  # [L, d/2]
        cos = torch.cat([ang.cos(), ang.cos()], dim=-1).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], dim=-1).to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def _layer(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c, w = self.config, self.w
        length = x.shape[0]
        h = self._norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(length, c.num_attention_heads, c.head_dim).transpose(0, 1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(length, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(length, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        q = self._rope(self._norm(q, w[p + "self_attn.q_norm.weight"]), length)
        k = self._cached(self._rope(self._norm(k, w[p + "self_attn.k_norm.weight"]), length))
        v = self._cached(v)
        rep = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(rep, dim=0)  # [heads, L, d]
        v = v.repeat_interleave(rep, dim=0)
        scores = (q.double() @ k.double().transpose(1, 2)) / math.sqrt(c.head_dim)  # [heads, L, L]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attn = (probs @ v.double()).to(x.dtype).transpose(0, 1).reshape(length, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = self._norm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    @torch.no_grad()
    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [L, 2] -> (text logits [L, vocab], audio logits [L, audio_vocab]), float32."""
        c, w = self.config, self.w
        rows = torch.as_tensor(rows, dtype=torch.long)
        x = torch.stack([
            w["model.audio_embed.weight"][a] if t == MODALITY_PAD else w["model.embed_tokens.weight"][t]
            for t, a in rows.tolist()
        ])  # [L, hidden]
        for i in range(c.num_shared_layers):
            x = self._layer(x, f"model.shared_block.layers.{i}.")
        text, audio = x, x
        for i in range(c.num_modality_layers):
            text = self._layer(text, f"model.text_block.layers.{i}.")
            audio = self._layer(audio, f"model.audio_block.layers.{i}.")
        text = self._norm(text, w["model.text_norm.weight"]) @ w["text_lm_head.weight"].T
        audio = self._norm(audio, w["model.audio_norm.weight"]) @ w["audio_lm_head.weight"].T
        return text.float(), audio.float()

    __call__ = forward


def dense_from_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                          dtype: torch.dtype = torch.float32, kv_fp8: bool = False) -> DenseMossSpeech:
    return DenseMossSpeech(config, state_dict, dtype, kv_fp8)


def read_checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (index + shards, or a single model.safetensors)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def dense_from_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, kv_fp8: bool = False
                          ) -> DenseMossSpeech:
    return DenseMossSpeech(ModelConfig.from_json(path), read_checkpoint_tensors(path), dtype, kv_fp8)
