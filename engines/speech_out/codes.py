"""Validation of audio codes handed to the decoder."""

from __future__ import annotations

import numpy as np
import torch

from engines.tokens import NUM_AUDIO_CODES


class BadCodesError(ValueError):
    """Codes given to the decoder are not a 1-D sequence of ints in [0, 16384)."""


def validate_codes(codes) -> list[int]:
    if isinstance(codes, torch.Tensor):
        codes = codes.detach().cpu().numpy()
    arr = np.asarray(codes)
    if arr.ndim != 1:
        raise BadCodesError(f"codes must be a 1-D sequence, got shape {arr.shape}")
    if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        raise BadCodesError(f"codes must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= NUM_AUDIO_CODES:
            bad = lo if lo < 0 else hi
            raise BadCodesError(f"audio code {bad} outside [0, {NUM_AUDIO_CODES}) (eosp 16384 and above are not "
                                f"speech codes)")
    return [int(c) for c in arr]
