"""Client audio in and out: PCM16 <-> float32, WAV reading, validation and resampling (soxr).

Resampling is streaming-capable: a `Resampler` fed 20 ms pieces gives the same samples as resampling the
whole signal at once (tested to 1e-6). Client rates (48 kHz WebRTC, 24 kHz API, 16 kHz, others) go to
16 kHz for the speech encoder; the 24 kHz codec output goes to 48 kHz for WebRTC.
"""

from server.audio.pcm import float32_to_pcm16, pcm16_to_float32, read_wav
from server.audio.resample import (
    MAX_RATE,
    MIN_RATE,
    AudioError,
    Resampler,
    resample,
    to_16k,
    validate_pcm,
    validate_rate,
)

__all__ = [
    "MAX_RATE", "MIN_RATE", "AudioError", "Resampler", "float32_to_pcm16", "pcm16_to_float32", "read_wav",
    "resample", "to_16k", "validate_pcm", "validate_rate",
]
