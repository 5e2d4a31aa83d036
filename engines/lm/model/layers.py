"""Building blocks of the serving model: parameters are allocated uninitialised (the loader fills them).

The GPU kernels (engines/kernels/lm) are imported inside the CUDA branches: they need Triton, which a CPU-only machine
may lack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.config import ModelConfig
from engines.lm.model.attention import paged_attention, write_kv
from engines.lm.model.batch import ForwardBatch
from engines.lm.model.fp8 import dequantize
from engines.lm.model.rope import apply_rope


def _empty(shape: tuple[int, ...], device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """Bias-free linear layer without init work (weights come from the loader)."""

    def __init__(self, out_features: int, in_features: int, device=None, dtype=None):
        super().__init__()
        self.weight = _empty((out_features, in_features), device, dtype)
        # (w8 [out, in] fp8, scale [out]) with the weight rounded to fp8 (engines/lm/model/fp8.py), or None. Set after
        # loading (fp8_copies.apply): decode-sized GEMMs read it; with keep_weights=False the weight is dropped (None)
        # and every GEMM reads it. Not a buffer: never saved or moved with the module.
        self.fp8: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (self.fp8 is None or x.dtype != torch.float32):
            from engines.kernels.lm import skinny_gemm

            return skinny_gemm.linear(x, self.weight, self.fp8)  # decode batch: a pass over the weight
        if self.weight is None:  # fp8 on a CPU or in float32: no kernel reads the copy, its exact values instead
            return F.linear(x, dequantize(*self.fp8, x.dtype))
        return F.linear(x, self.weight)

    def glu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this (gate; up) layer in one kernel where the rows are decode-sized, else None."""
        from engines.kernels.lm import skinny_gemm

        return skinny_gemm.glu(x, self.weight, self.fp8)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = _empty((num, dim), device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = _empty((dim,), device, dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rounding order of the reference: normalise in float32, round to the activation dtype,
        # then multiply by the weight in that dtype (in bf16 this is two roundings, not one).
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add fused with the next norm on GPU."""
        if x.is_cuda:
            from engines.kernels.lm.fused import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x


class DecoderLayer(nn.Module):
    """Qwen3 decoder layer with fused qkv and gate_up projections, over the paged KV cache."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.ffn = config.intermediate_size
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, device, dtype)
        self.qkv_proj = Linear(self.q_size + 2 * self.kv_size, h, device, dtype)
        self.q_norm = RMSNorm(d, eps, device, dtype)
        self.k_norm = RMSNorm(d, eps, device, dtype)
        self.o_proj = Linear(h, self.q_size, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, device, dtype)
        self.gate_up_proj = Linear(2 * self.ffn, h, device, dtype)
        self.down_proj = Linear(h, self.ffn, device, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, batch: ForwardBatch, out_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is x + residual (residual None for the first layer); returns (mlp_out, residual),
        whose sum is the layer's output, so the add can fuse into the next norm.

        x: [T, hidden]; kv_layer: [2, num_blocks, block_size, kv_heads, head_dim]. Every row writes its K/V.
        With `out_rows` ([R]) only those rows go through o_proj and the MLP and [R, hidden] comes back
        (the last layer of a tail feeds only the rows that need logits).
        """
        t = x.shape[0]
        h, residual = self.input_layernorm.add(x, residual)
        qkv = self.qkv_proj(h)  # [T, q + 2 kv]
        if qkv.is_cuda:
            from engines.kernels.lm.fused import qk_norm_rope_write_kv

            q = qk_norm_rope_write_kv(qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, kv_layer[0],
                                      kv_layer[1], batch.slot_mapping, self.num_heads, self.num_kv_heads,
                                      self.q_norm.eps)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), cos, sin)
            k = apply_rope(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), cos, sin)
            write_kv(k, v.reshape(t, self.num_kv_heads, self.head_dim), kv_layer[0], kv_layer[1],
                     batch.slot_mapping)
        attn = paged_attention(q, kv_layer[0], kv_layer[1], batch).reshape(t, self.q_size)  # [T, q]
        if out_rows is not None:
            residual, attn = residual[out_rows], attn[out_rows]
        h, residual = self.post_attention_layernorm.add(self.o_proj(attn), residual)
        if h.is_cuda:
            from engines.kernels.lm.fused import silu_mul

            act = self.gate_up_proj.glu(h)  # [T, ffn], in gate_up's epilogue at decode sizes
            if act is None:
                act = silu_mul(self.gate_up_proj(h))
        else:
            gate_up = self.gate_up_proj(h)  # [T, 2 ffn]
            gate, up = gate_up.split(self.ffn, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act), residual
