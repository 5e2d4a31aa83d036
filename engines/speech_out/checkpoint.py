"""Loading `.pt` state dicts with every key checked by name, shape and dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from engines.config import ConfigError
from engines.lm.loader.mismatch import key_mismatches


class CheckpointError(ConfigError):
    """A codec checkpoint file is missing, unreadable, or its keys/shapes do not match the model."""


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"codec checkpoint {path} does not exist")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for corrupt or pickled-code files
        raise CheckpointError(f"{path}: cannot read as a torch state dict ({e})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: expected a flat dict of tensors")
    return sd


def _canonical_weight_norm(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Old-style weight norm keys (`weight_g`/`weight_v`) -> parametrization keys, so both exports load."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight_g"):
            k = k[: -len("weight_g")] + "parametrizations.weight.original0"
        elif k.endswith(".weight_v"):
            k = k[: -len("weight_v")] + "parametrizations.weight.original1"
        out[k] = v
    return out


def _canonical(sd: dict[str, torch.Tensor], strip_prefix: str, weight_norm_aliases: bool) -> dict[str, torch.Tensor]:
    if strip_prefix:
        sd = {k[len(strip_prefix):] if k.startswith(strip_prefix) else k: v for k, v in sd.items()}
    return _canonical_weight_norm(sd) if weight_norm_aliases else sd


def state_problems(module: torch.nn.Module, sd: dict[str, torch.Tensor], *, strip_prefix: str = "",
                   weight_norm_aliases: bool = False) -> list[str]:
    """What keeps `sd` from loading into `module`: missing, unexpected and wrongly shaped keys, and tensors of
    another dtype than the module's (the codec's .pt files are float32)."""
    sd = _canonical(sd, strip_prefix, weight_norm_aliases)
    want = module.state_dict()
    problems = key_mismatches({k: tuple(v.shape) for k, v in want.items()}, {k: tuple(v.shape) for k, v in sd.items()})
    wrong = sorted(f"{k}: {sd[k].dtype} != expected {v.dtype}" for k, v in want.items()
                   if k in sd and sd[k].dtype != v.dtype)
    if wrong:
        more = " ..." if len(wrong) > 20 else ""
        problems.append(f"wrong dtype {len(wrong)}: {wrong[:20]}{more}")
    return problems


def load_checked(module: torch.nn.Module, sd: dict[str, torch.Tensor], source: str, *,
                 strip_prefix: str = "", weight_norm_aliases: bool = False) -> None:
    """Load `sd` into `module`; every `state_problems` is named in one error."""
    problems = state_problems(module, sd, strip_prefix=strip_prefix, weight_norm_aliases=weight_norm_aliases)
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    module.load_state_dict(_canonical(sd, strip_prefix, weight_norm_aliases), strict=True)
