"""PCM helpers for the server: the pure-numpy codec helpers plus WAV reading at a target rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.audio.wav import AudioFormatError, float32_to_pcm16
from engines.audio.wav import pcm16_to_float32 as _pcm16_to_float32
from engines.audio.wav import read_wav as _read_wav_native
from server.audio.resample import AudioError, resample

__all__ = ["float32_to_pcm16", "pcm16_to_float32", "read_wav"]


def pcm16_to_float32(data: bytes | bytearray | memoryview) -> np.ndarray:
    try:
        return _pcm16_to_float32(data)
    except AudioFormatError as e:
        raise AudioError(str(e)) from None


def read_wav(path: str | Path, target_rate: int | None = None) -> tuple[np.ndarray, int]:
    """WAV -> (mono float32, rate); resampled to target_rate when given."""
    try:
        x, rate = _read_wav_native(path)
    except AudioFormatError as e:
        raise AudioError(str(e)) from None
    if target_rate is not None and target_rate != rate:
        x, rate = resample(x, rate, target_rate), target_rate
    return x, rate
