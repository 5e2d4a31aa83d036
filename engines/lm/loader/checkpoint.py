"""Load a MOSS-Speech checkpoint (sharded safetensors in the release's key layout) into the serving model.

Tensors are read one at a time from memory-mapped shards and copied straight into the model's
parameters on the target device, so the host never holds a full (or float32) copy of the model.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engines.config import ModelConfig, parse_dtype
from engines.lm.loader.keys import checkpoint_shapes, is_norm_key, random_fill_, serving_sources
from engines.lm.model.moss import MossSpeechModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class CheckpointError(ValueError):
    """The checkpoint does not match the expected layout; the message lists every offending key."""


def read_weight_map(path: str | Path) -> dict[str, Path]:
    """Checkpoint key -> shard file, from the index, or from a single `model.safetensors`."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            raw = json.loads(index.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index}: invalid JSON ({e})") from None
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: needs a 'weight_map' object of key -> shard file name")
        return {k: path / v for k, v in weight_map.items()}
    single = path / SINGLE_FILE
    if single.exists():
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def _open_shards(stack: ExitStack, weight_map: dict[str, Path], problems: list[str]) -> dict[str, object]:
    """Open each shard once; key -> open handle for keys that are really in their shard."""
    handles: dict[Path, object] = {}
    by_key: dict[str, object] = {}
    for key, file in sorted(weight_map.items()):
        if file not in handles:
            if not file.exists():
                handles[file] = None
            else:
                try:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                except Exception as e:  # safetensors raises its own error types for corrupt headers
                    raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
        handle = handles[file]
        if handle is None:
            problems.append(f"{key}: shard file {file.name} does not exist")
        elif key not in handle.keys():
            problems.append(f"{key}: listed in the index for {file.name} but not stored in it")
        else:
            by_key[key] = handle
    return by_key


def _check(config: ModelConfig, weight_map: dict[str, Path], by_key: dict[str, object], problems: list[str]) -> None:
    expected = checkpoint_shapes(config)
    want_dtype = config.dtype
    for key in expected:
        if key not in weight_map:
            problems.append(f"{key}: missing")
    for key in weight_map:
        if key not in expected:
            problems.append(f"{key}: unexpected key")
    for key, handle in by_key.items():
        if key not in expected:
            continue
        sl = handle.get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != expected[key]:
            problems.append(f"{key}: shape {list(shape)}, expected {list(expected[key])}")
        dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
        if dtype != want_dtype:
            problems.append(f"{key}: dtype {sl.get_dtype()}, expected {config.torch_dtype} (config torch_dtype)")


def _problem_text(path: str | Path, problems: list[str]) -> str:
    return f"{path}: {len(problems)} problem(s) in checkpoint:\n  " + "\n  ".join(problems)


def checkpoint_problems(path: str | Path, config: ModelConfig) -> list[str]:
    """Every missing, unexpected, wrongly shaped or typed tensor and missing shard of the checkpoint at `path`:
    what `load_weights` refuses, without loading a tensor."""
    try:
        weight_map = read_weight_map(path)
        problems: list[str] = []
        with ExitStack() as stack:
            by_key = _open_shards(stack, weight_map, problems)
            _check(config, weight_map, by_key, problems)
    except CheckpointError as e:
        return [str(e)]
    return [_problem_text(path, problems)] if problems else []


def load_weights(model: MossSpeechModel, path: str | Path) -> None:
    """Fill an existing serving model from the checkpoint at `path`, fusing q/k/v and gate/up."""
    config = model.config
    weight_map = read_weight_map(path)
    problems: list[str] = []
    with ExitStack() as stack:
        by_key = _open_shards(stack, weight_map, problems)
        _check(config, weight_map, by_key, problems)
        if problems:
            raise CheckpointError(_problem_text(path, problems))
        params = dict(model.named_parameters())
        for name, keys in serving_sources(config).items():
            param = params[name]
            offset = 0
            for key in keys:
                t = by_key[key].get_tensor(key)  # one tensor at a time, in the file's dtype
                param.data[offset:offset + t.shape[0]].copy_(t)
                offset += t.shape[0]


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None
               ) -> MossSpeechModel:
    """Read config.json and the weights of a checkpoint directory; dtype defaults to the config's."""
    config = ModelConfig.from_json(path)
    model = MossSpeechModel(config, device=torch.device(device), dtype=parse_dtype(dtype or config.dtype))
    load_weights(model, path)
    return model.eval()


def random_model(config: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
                 seed: int = 0) -> MossSpeechModel:
    """A randomly initialised serving model, initialised on `device` (fast at full size on a GPU)."""
    device = torch.device(device)
    model = MossSpeechModel(config, device=device, dtype=parse_dtype(dtype or config.dtype))
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        random_fill_(param.data, is_norm_key(name), gen)
    return model.eval()
