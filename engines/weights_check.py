"""Every file, key, shape and dtype a downloaded model and codec must have, named problem by problem.

`moss-speech check-weights` prints these problems; the engine process runs the same check before it loads a model or
codec directory and refuses to start with the same text (`require_weights`). The loaders themselves check the tensors
they read with the same functions (engines/lm/loader/checkpoint.py, engines/speech_in/weights.py,
engines/speech_out/checkpoint.py), so no key is skipped or loaded non-strictly.

Model directory (fnlp/MOSS-Speech): config.json, tokenizer.json (its control tokens at the ids the engine uses),
model.safetensors.index.json and its shards (or one model.safetensors), 446 tensors at full size in the config's dtype.
Codec directory (fnlp/MOSS-Speech-Codec): config.json (+ preprocessor_config.json) and model.safetensors for the
speech encoder; flow/flow.pt (offline flow) and flow/flow-chunk-5.pt (the chunk-streaming flow), the same tensors;
flow/hift.pt (the vocoder); flow/campplus.onnx (the speaker embedding: fbank [1, T, 80] in, [1, 192] out). The .pt
files hold float32 tensors; flow/decoder.json, when present (random codecs), gives the decoder's shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engines.config import PRESETS, ConfigError, ModelConfig, ignored_config_keys
from engines.lm.loader.checkpoint import checkpoint_problems
from engines.speech_in.config import EncoderConfig
from engines.speech_in.weights import file_problems
from engines.speech_out.checkpoint import CheckpointError, read_state_dict, state_problems
from engines.speech_out.config import CodecDecoderConfig
from engines.speech_out.decoder import build_modules
from engines.speech_out.presets import DECODER_PRESETS
from engines.tokens import ENDOFTEXT, IM_END, IM_START, OBJECT_REF_START

CONTROL_TOKENS = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END,
                  "<|object_ref_start|>": OBJECT_REF_START}
FLOW_FILES = ("flow/flow.pt", "flow/flow-chunk-5.pt")
HIFT_FILE = "flow/hift.pt"
CAMPPLUS_FILE = "flow/campplus.onnx"


class WeightsError(ConfigError):
    """A model or codec directory lacks a file, key, shape or dtype it must have; the message names each problem."""


def model_problems(path: str | Path) -> list[str]:
    """Problems of a language model directory, one line each."""
    path = Path(path)
    problems = _tokenizer_problems(path / "tokenizer.json")
    try:
        config = ModelConfig.from_json(path)
    except ConfigError as e:
        return [str(e), *problems]
    return checkpoint_problems(path, config) + problems


def model_notes(path: str | Path) -> list[str]:
    """config.json keys the model neither reads, nor checks, nor knows to be inert: named, not refused."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    keys = ignored_config_keys(raw) if isinstance(raw, dict) else []
    return [f"{Path(path) / 'config.json'}: keys not read {keys}"] if keys else []


def _tokenizer_problems(file: Path) -> list[str]:
    if not file.is_file():
        return [f"{file}: missing (the text tokenizer)"]
    from tokenizers import Tokenizer  # optional at import: random presets run without it

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers package raises its own exception type
        return [f"{file}: unreadable ({e})"]
    return [f"{file}: {name} has id {tok.token_to_id(name)}, expected {want}"
            for name, want in CONTROL_TOKENS.items() if tok.token_to_id(name) != want]


def codec_problems(path: str | Path) -> list[str]:
    """Problems of a codec directory (encoder and decoder halves), one line each."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: no such codec directory"]
    try:
        enc_cfg = EncoderConfig.from_dir(path)
        problems = file_problems(path, enc_cfg)
    except ConfigError as e:
        problems = [str(e)]
    dec_json = path / "flow" / "decoder.json"
    try:
        cfg = CodecDecoderConfig.from_json(dec_json) if dec_json.is_file() else CodecDecoderConfig()
    except ConfigError as e:
        return [*problems, str(e)]
    flow, hift, _ = build_modules(cfg, with_bigvgan=False)
    for name in FLOW_FILES:
        problems += _state_file_problems(path / name, flow)
    problems += _state_file_problems(path / HIFT_FILE, hift.generator, strip_prefix="generator.",
                                     weight_norm_aliases=True)
    return problems + _campplus_problems(path / CAMPPLUS_FILE, cfg.flow.mel.n_mels, cfg.flow.spk_embed_dim)


def _state_file_problems(file: Path, module: torch.nn.Module, **kw) -> list[str]:
    try:
        sd = read_state_dict(file)
    except CheckpointError as e:
        return [str(e)]
    found = state_problems(module, sd, **kw)
    return [f"{file}: " + "; ".join(found)] if found else []


def _campplus_problems(file: Path, n_mels: int, dim: int) -> list[str]:
    if not file.is_file():
        return [f"{file}: missing (the speaker embedding model)"]
    import onnxruntime as ort  # optional at import: only the codec's speaker embedding needs it

    try:
        sess = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        return [f"{file}: unreadable ONNX model ({e})"]
    ins, outs = sess.get_inputs(), sess.get_outputs()
    problems = []
    if len(ins) != 1 or len(ins[0].shape) != 3 or ins[0].shape[2] != n_mels:
        problems.append(f"{file}: inputs {[i.shape for i in ins]}, expected one [1, frames, {n_mels}] fbank")
    if len(outs) != 1 or not outs[0].shape or outs[0].shape[-1] != dim:
        problems.append(f"{file}: outputs {[o.shape for o in outs]}, expected one [1, {dim}] embedding")
    return problems


def weights_problems(model: str | None, codec: str | None) -> list[str]:
    """Problems of a model and a codec directory; a preset name (random weights) or None has none."""
    problems = []
    if model is not None and model not in PRESETS:
        problems += model_problems(model)
    if codec is not None and codec not in DECODER_PRESETS and codec != "none":
        problems += codec_problems(codec)
    return problems


def problems_text(problems: list[str]) -> str:
    return f"{len(problems)} problem(s) in the weights:\n" + "\n".join(f"  - {p}" for p in problems)


def require_weights(model: str | None, codec: str | None) -> None:
    """Raise WeightsError naming every problem of the model and codec directories (presets pass)."""
    problems = weights_problems(model, codec)
    if problems:
        raise WeightsError(problems_text(problems))
