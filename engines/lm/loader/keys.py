"""The checkpoint's key layout of the published release and how it maps onto the serving model.

Checkpoint layers are numbered per block (`shared_block.layers.0-31`, `text_block.layers.0-3`,
`audio_block.layers.0-3`); the serving model keeps one flat `layers` list in KV-cache order
(shared, then text tail, then audio tail) and fuses q/k/v and gate/up into one matrix each.
"""

from __future__ import annotations

import torch

from engines.config import ModelConfig

# Per-layer tensors of the checkpoint, in the order the release lists them.
LAYER_KEYS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)

# Serving parameter (inside `layers.{n}.`) <- checkpoint tensors concatenated along dim 0.
_LAYER_SOURCES = {
    "qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj.weight": ("self_attn.o_proj",),
    "q_norm.weight": ("self_attn.q_norm",),
    "k_norm.weight": ("self_attn.k_norm",),
    "input_layernorm.weight": ("input_layernorm",),
    "post_attention_layernorm.weight": ("post_attention_layernorm",),
    "gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj.weight": ("mlp.down_proj",),
}

_GLOBAL_SOURCES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "audio_embed.weight": "model.audio_embed.weight",
    "text_norm.weight": "model.text_norm.weight",
    "audio_norm.weight": "model.audio_norm.weight",
    "text_lm_head.weight": "text_lm_head.weight",
    "audio_lm_head.weight": "audio_lm_head.weight",
}


def checkpoint_layer_prefixes(config: ModelConfig) -> list[str]:
    """Checkpoint prefix of every attention layer, in KV-cache layer order."""
    out = [f"model.shared_block.layers.{i}." for i in range(config.num_shared_layers)]
    out += [f"model.text_block.layers.{i}." for i in range(config.num_modality_layers)]
    out += [f"model.audio_block.layers.{i}." for i in range(config.num_modality_layers)]
    return out


def _layer_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    h, d = config.hidden_size, config.head_dim
    q, kv, ffn = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return {
        "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q), "self_attn.q_norm": (d,), "self_attn.k_norm": (d,),
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "mlp.gate_proj": (ffn, h), "mlp.up_proj": (ffn, h), "mlp.down_proj": (h, ffn),
    }[name]


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key with its shape (446 keys at full size); no tensor is allocated."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.audio_embed.weight": (config.audio_vocab_size, h),
    }
    for prefix in checkpoint_layer_prefixes(config):
        for name in LAYER_KEYS:
            shapes[f"{prefix}{name}.weight"] = _layer_shape(config, name)
    shapes["model.text_norm.weight"] = (h,)
    shapes["model.audio_norm.weight"] = (h,)
    shapes["text_lm_head.weight"] = (config.vocab_size, h)
    shapes["audio_lm_head.weight"] = (config.audio_vocab_size, h)
    return shapes


def serving_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Serving parameter name -> checkpoint keys that are concatenated (dim 0) to form it."""
    out = {name: [key] for name, key in _GLOBAL_SOURCES.items()}
    for n, prefix in enumerate(checkpoint_layer_prefixes(config)):
        for name, parts in _LAYER_SOURCES.items():
            out[f"layers.{n}.{name}"] = [f"{prefix}{p}.weight" for p in parts]
    return out


def is_norm_key(name: str) -> bool:
    return "norm" in name


def random_fill_(t: torch.Tensor, is_norm: bool, generator: torch.Generator) -> torch.Tensor:
    """Random init shared by the random model and the random checkpoint writer.

    Matrices ~ N(0, 0.02); norm weights ~ 1 + N(0, 0.1) so the QK-norm and final-norm scales matter.
    """
    if is_norm:
        t.normal_(1.0, 0.1, generator=generator)
    else:
        t.normal_(0.0, 0.02, generator=generator)
    return t
