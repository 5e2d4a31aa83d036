"""WAV files and PCM16 bytes <-> float32 samples, with the standard library and numpy only.

Shared by the codec commands and the server (server/audio/pcm.py), so engines never imports server.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np


class AudioFormatError(ValueError):
    """Bytes or a file that are not the PCM they claim to be."""


def pcm16_to_float32(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Little-endian signed 16-bit PCM -> float32 in [-1, 1)."""
    if len(data) % 2:
        raise AudioFormatError(f"PCM16 needs an even number of bytes, got {len(data)}")
    return np.frombuffer(bytes(data), dtype="<i2").astype(np.float32) / 32768.0


def float32_to_pcm16(samples: np.ndarray) -> bytes:
    """float samples -> little-endian signed 16-bit PCM: x * 32768 rounded, saturated to the int16 range.

    The inverse of `pcm16_to_float32`, so a round trip is within half a step (1.0 saturates to 32767).
    """
    x = np.round(np.asarray(samples, dtype=np.float64) * 32768.0)
    return np.clip(x, -32768, 32767).astype("<i2").tobytes()


def _decode_frames(raw: bytes, width: int) -> np.ndarray:
    if width == 1:  # 8-bit WAV is unsigned
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        return v.astype(np.float32) / float(1 << 23)
    if width == 4:
        return (np.frombuffer(raw, dtype="<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    raise AudioFormatError(f"unsupported WAV sample width {width} bytes")


@dataclass(frozen=True)
class WavHeader:
    channels: int
    width: int  # bytes per sample
    rate: int
    frames: int  # frames present: the header's count, or fewer where the data ends sooner

    @property
    def seconds(self) -> float:
        return self.frames / self.rate if self.rate > 0 else float("inf")


def _source(path: str | Path | bytes) -> str | io.BytesIO:
    return io.BytesIO(path) if isinstance(path, bytes | bytearray) else str(path)


def _name(path: str | Path | bytes) -> str:
    return "WAV data" if isinstance(path, bytes | bytearray) else str(path)


def read_wav_header(path: str | Path | bytes) -> WavHeader:
    """What an integer-PCM WAV file (a path or its bytes) holds, from its header, without decoding its samples. The
    frame count is bounded by the file's size: a header may claim more than the file holds."""
    try:
        size = len(path) if isinstance(path, bytes | bytearray) else Path(path).stat().st_size
        with wave.open(_source(path), "rb") as w:
            channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
    except FileNotFoundError:
        raise AudioFormatError(f"no such WAV file: {path}") from None
    except (wave.Error, EOFError) as e:
        raise AudioFormatError(f"{_name(path)}: not a PCM WAV file ({e}); float WAVs are not read here") from None
    return WavHeader(channels, width, rate, min(n, size // max(1, channels * width)))


def read_wav(path: str | Path | bytes) -> tuple[np.ndarray, int]:
    """Integer-PCM WAV (a path or its bytes) -> (mono float32 samples [n], sample rate). Channels are averaged."""
    try:
        with wave.open(_source(path), "rb") as w:
            channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except FileNotFoundError:
        raise AudioFormatError(f"no such WAV file: {path}") from None
    except (wave.Error, EOFError) as e:
        raise AudioFormatError(f"{_name(path)}: not a PCM WAV file ({e}); float WAVs are not read here") from None
    x = _decode_frames(raw, width)
    if channels > 1:
        x = x[: len(x) // channels * channels].reshape(-1, channels).mean(axis=1)
    return np.ascontiguousarray(x, dtype=np.float32), rate


def write_wav(path: str | Path | BinaryIO, samples: np.ndarray, rate: int) -> None:
    """Mono float samples -> 16-bit PCM WAV (a path, or a binary file open for writing)."""
    with wave.open(path if hasattr(path, "write") else str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes(float32_to_pcm16(samples))
