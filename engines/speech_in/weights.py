"""The encoder's tensors in the codec's `model.safetensors`: names, checked loading, random writing.

Names are the real checkpoint's: everything under `encoder.` (conv1, conv2, embed_positions,
layers.N.{self_attn.{q,k,v,out}_proj, self_attn_layer_norm, fc1, fc2, final_layer_norm}, codebook).
Tensors of other codec parts (no `encoder.` prefix) are not ours and are skipped. Under `encoder.`, a
few names are known to be present in real checkpoints and unused by inference; they are skipped by
name; any other extra tensor is an error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines.config import ConfigError
from engines.lm.loader.mismatch import key_mismatches
from engines.speech_in.config import EncoderConfig

PREFIX = "encoder."
WEIGHTS_FILE = "model.safetensors"
_SAFETENSORS_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class EncoderCheckpointError(ConfigError):
    """The checkpoint's tensors do not match the encoder config; the message lists every problem."""


def expected_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Full checkpoint name -> shape, for every tensor the encoder needs."""
    d, f = cfg.d_model, cfg.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {
        "conv1.weight": (d, cfg.num_mel_bins, 3), "conv1.bias": (d,),
        "conv2.weight": (d, d, 3), "conv2.bias": (d,),
        "embed_positions.weight": (cfg.max_source_positions, d),
        "codebook.weight": (cfg.codebook_size, d),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for proj in ("q_proj", "v_proj", "out_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (d, d)
            shapes[p + f"self_attn.{proj}.bias"] = (d,)
        shapes[p + "self_attn.k_proj.weight"] = (d, d)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[p + f"{norm}.weight"] = (d,)
            shapes[p + f"{norm}.bias"] = (d,)
        shapes[p + "fc1.weight"], shapes[p + "fc1.bias"] = (f, d), (f,)
        shapes[p + "fc2.weight"], shapes[p + "fc2.bias"] = (d, f), (d,)
    return {PREFIX + k: v for k, v in shapes.items()}


def _ignored(name: str, cfg: EncoderConfig) -> bool:
    """Real-checkpoint tensors under `encoder.` that inference does not use."""
    local = name[len(PREFIX):]
    if local in ("embed_positions2.weight", "ema_count", "ema_weight", "layer_norm.weight", "layer_norm.bias"):
        return True  # post-pool positions (no layer after the pool), VQ training EMA, post-trunk norm
    m = re.match(r"layers\.(\d+)\.", local)
    # Layers past the quantizer, up to the trunk's depth in config.json.
    return bool(m) and cfg.num_layers <= int(m.group(1)) < cfg.total_layers


def tensor_problems(cfg: EncoderConfig, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> list[str]:
    """Missing, unexpected and wrong-shape tensors under `encoder.`, and tensors not of the config's torch_dtype
    (`dtypes`: safetensors dtype names, e.g. "F32")."""
    ours = {k: v for k, v in shapes.items() if k.startswith(PREFIX)}
    problems = key_mismatches(expected_shapes(cfg), ours, ignored=lambda k: _ignored(k, cfg))
    want = _SAFETENSORS_NAMES[cfg.torch_dtype]
    wrong = sorted(f"{k}: {dtypes[k]} != expected {want}" for k in expected_shapes(cfg) if k in dtypes
                   and dtypes[k] != want)
    if wrong:
        more = " ..." if len(wrong) > 20 else ""
        problems.append(f"wrong dtype {len(wrong)} (config torch_dtype {cfg.torch_dtype}): {wrong[:20]}{more}")
    return problems


def file_problems(path: str | Path, cfg: EncoderConfig) -> list[str]:
    """`tensor_problems` of a codec directory's (or file's) model.safetensors, each naming the file."""
    file = Path(path)
    if file.is_dir():
        file = file / WEIGHTS_FILE
    if not file.exists():
        return [f"{file}: missing (the speech encoder's weights)"]
    try:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            slices = {k: fh.get_slice(k) for k in fh.keys()}
            shapes = {k: tuple(s.get_shape()) for k, s in slices.items()}
            dtypes = {k: s.get_dtype() for k, s in slices.items()}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        return [f"{file}: unreadable safetensors file ({e})"]
    problems = tensor_problems(cfg, shapes, dtypes)
    return [f"{file}: encoder tensors do not match the config", *problems] if problems else []


def load_state(path: str | Path, cfg: EncoderConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """Read and check the encoder's tensors (names without the `encoder.` prefix)."""
    file = Path(path)
    if file.is_dir():
        file = file / WEIGHTS_FILE
    problems = file_problems(file, cfg)
    if problems:
        raise EncoderCheckpointError("; ".join(problems))
    with safe_open(str(file), framework="pt", device="cpu") as fh:
        return {k[len(PREFIX):]: fh.get_tensor(k).to(device) for k in expected_shapes(cfg)}


def random_state(cfg: EncoderConfig, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random tensors in the real layout (full names), scaled so activations and codes are non-degenerate."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(("layer_norm.weight",)):
            t = torch.ones(shape, device=device)
        elif name.endswith("layer_norm.bias"):
            t = torch.zeros(shape, device=device)
        else:
            fan_in = shape[1] * (shape[2] if len(shape) == 3 else 1) if len(shape) > 1 else 1
            std = 1.0 if name.endswith(("codebook.weight", "embed_positions.weight")) else fan_in ** -0.5
            if name.endswith(".bias"):
                std = 0.02
            t = torch.randn(shape, generator=gen, device=device) * std
        out[name] = t.to(dtype)
    # The real checkpoint also carries post-pool positions; write them so the layout is complete.
    out[PREFIX + "embed_positions2.weight"] = out[PREFIX + "embed_positions.weight"][: cfg.codes_per_segment].clone()
    return out


def write_random_encoder(out_dir: str | Path, cfg: EncoderConfig, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> Path:
    """Write `model.safetensors` + the encoder keys of `config.json` + `preprocessor_config.json`.

    An existing `config.json` (e.g. written by the decoder's writer) is merged into, not replaced.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in random_state(cfg, seed, dtype=dtype).items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    merged = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    merged.update(cfg.to_config_json())
    cfg_path.write_text(json.dumps(merged, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(cfg.to_preprocessor_json(), indent=2) + "\n")
    return out
