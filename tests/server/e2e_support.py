"""What the end-to-end server tests send: 24 kHz audio as the base64 PCM16 pieces of input_audio_buffer.append."""

from __future__ import annotations

import base64

import numpy as np

from server.audio.pcm import float32_to_pcm16


def b64_chunks(pcm24k: np.ndarray, ms: int = 100) -> list[str]:
    step = 24000 * ms // 1000
    return [base64.b64encode(float32_to_pcm16(pcm24k[i:i + step])).decode() for i in range(0, len(pcm24k), step)]
