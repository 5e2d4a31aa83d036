"""The audio formats of the Realtime API's events: 24 kHz PCM16, and G.711 mu-law / A-law at 8 kHz (what telephone
lines carry: a call bridged from a phone network streams its bytes as they come, with no transcoding of its own).

An `AudioFormat` turns an event's bytes into float32 samples at its rate and back; `AnswerEncoder` turns one
answer's 24 kHz PCM chunks into the format, resampling as a stream so chunk seams carry no filter edges. G.711 is
coded by FFmpeg's codecs (PyAV): it is sample by sample, so a codec per call holds no state across calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from server.audio.pcm import float32_to_pcm16, pcm16_to_float32
from server.audio.resample import AudioError, Resampler

G711_RATE = 8000


class FormatError(ValueError):
    """An audio format the API does not take; `param` is the offending sub-field ("type" or "rate")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AudioFormat:
    type: str  # "audio/pcm" | "audio/pcmu" | "audio/pcma"
    rate: int
    codec: str | None  # FFmpeg's G.711 codec; None for PCM16

    def to_event(self) -> dict[str, Any]:
        """As session and response events show it (the GA shape: G.711 formats carry no rate)."""
        return {"type": self.type, "rate": self.rate} if self.codec is None else {"type": self.type}

    def decode(self, raw: bytes) -> np.ndarray:
        """An event's bytes -> float32 [n] in [-1, 1) at `rate`."""
        if self.codec is None:
            if len(raw) % 2:
                raise AudioError("audio has an odd number of bytes (PCM16 needs 2 per sample)")
            return pcm16_to_float32(raw)
        if not raw:
            return np.zeros(0, np.float32)
        ctx = av.CodecContext.create(self.codec, "r")
        ctx.sample_rate, ctx.layout = self.rate, "mono"
        pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in ctx.decode(av.Packet(raw))])  # [n] int16
        return pcm.astype(np.float32) / 32768.0

    def encode(self, x: np.ndarray) -> bytes:
        """float32 [n] at `rate` -> the event's bytes."""
        pcm = float32_to_pcm16(x)
        if self.codec is None or not pcm:
            return pcm
        ctx = av.CodecContext.create(self.codec, "w")
        ctx.sample_rate, ctx.layout, ctx.format = self.rate, "mono", "s16"
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm, "<i2")[None], format="s16", layout="mono")
        frame.sample_rate = self.rate
        return b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])


PCM = AudioFormat("audio/pcm", 24000, None)
PCMU = AudioFormat("audio/pcmu", G711_RATE, "pcm_mulaw")
PCMA = AudioFormat("audio/pcma", G711_RATE, "pcm_alaw")
_BY_TYPE = {f.type: f for f in (PCM, PCMU, PCMA)}


def parse_format(v: dict[str, Any]) -> AudioFormat:
    """A GA format object ({"type", "rate"}, both optional: PCM at 24 kHz unless said) -> its AudioFormat."""
    fmt = _BY_TYPE.get(v.get("type", PCM.type)) if isinstance(v.get("type", PCM.type), str) else None
    if fmt is None:
        raise FormatError(f"type {v.get('type')!r} is not supported (one of {', '.join(_BY_TYPE)})", "type")
    if v.get("rate", fmt.rate) != fmt.rate or isinstance(v.get("rate"), bool):
        raise FormatError(f"rate must be {fmt.rate} for {fmt.type}, got {v.get('rate')!r}", "rate")
    return fmt


class AnswerEncoder:
    """One answer's audio, 24 kHz PCM16 chunks in, the format's bytes out; `flush()` gives the resampler's tail."""

    def __init__(self, fmt: AudioFormat, in_rate: int) -> None:
        self.fmt = fmt
        self._resampler = None if fmt.rate == in_rate else Resampler(in_rate, fmt.rate)

    def encode(self, pcm16: bytes) -> bytes:
        if self.fmt is PCM and self._resampler is None:
            return pcm16
        x = pcm16_to_float32(pcm16)
        return self.fmt.encode(x if self._resampler is None else self._resampler.process(x))

    def flush(self) -> bytes:
        if self._resampler is None or self._resampler.closed:
            return b""
        return self.fmt.encode(self._resampler.flush())
