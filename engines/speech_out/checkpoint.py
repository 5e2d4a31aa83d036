"""Loading `.pt` state dicts with every key checked by name."""

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


def load_checked(module: torch.nn.Module, sd: dict[str, torch.Tensor], source: str, *,
                 strip_prefix: str = "", weight_norm_aliases: bool = False) -> None:
    """Load `sd` into `module`; any missing, unexpected or wrongly shaped key is named in one error."""
    if strip_prefix:
        sd = {k[len(strip_prefix):] if k.startswith(strip_prefix) else k: v for k, v in sd.items()}
    if weight_norm_aliases:
        sd = _canonical_weight_norm(sd)
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    problems = key_mismatches(expected, {k: tuple(v.shape) for k, v in sd.items()})
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    module.load_state_dict(sd, strict=True)
