"""Inference-only tensors derived from a module's weights (fused q/k/v and the like): when to rebuild them."""

from __future__ import annotations

from torch import nn


def weights_key(module: nn.Module) -> tuple:
    """Changes when any weight of `module` is replaced, moved, cast or written in place (load_state_dict bumps
    _version): the key a cache of derived tensors compares against."""
    return tuple((p.data_ptr(), p.dtype, p._version) for p in module.parameters())
