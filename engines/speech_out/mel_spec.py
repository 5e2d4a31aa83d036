"""The codec's mel definition and a torch implementation of it (log of an 80-band Slaney mel magnitude).

The flow is trained to produce this mel and each vocoder to consume it; a vocoder built for another mel
(BigVGAN's public 22 kHz/80-band or 24 kHz/100-band checkpoints) would produce wrong audio, so the loader
compares definitions and refuses a mismatch (`check_same_mel`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from engines.audio.melscale import mel_filterbank
from engines.config import ConfigError


class MelMismatchError(ConfigError):
    """A vocoder's mel definition differs from the flow's."""


@dataclass(frozen=True)
class MelSpec:
    sample_rate: int = 24000
    n_mels: int = 80
    hop: int = 480
    n_fft: int = 1920
    win: int = 1920
    fmin: float = 0.0
    fmax: float = 8000.0
    center: bool = False

    def __post_init__(self) -> None:
        for f in ("sample_rate", "n_mels", "hop", "n_fft", "win"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"MelSpec.{f} must be a positive int, got {v!r}")
        if self.win > self.n_fft:
            raise ConfigError(f"MelSpec.win {self.win} > n_fft {self.n_fft}")
        if not 0 <= self.fmin < self.fmax <= self.sample_rate / 2:
            raise ConfigError(f"MelSpec needs 0 <= fmin < fmax <= sample_rate/2, got {self.fmin}, {self.fmax}")

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


CODEC_MEL = MelSpec()
# log(1e-5): the value the log-mel takes on digital silence (magnitudes are clamped at 1e-5).
SILENCE_LOG_MEL = math.log(1e-5)


def check_same_mel(flow_mel: MelSpec, vocoder_mel: MelSpec, vocoder_name: str) -> None:
    if flow_mel != vocoder_mel:
        raise MelMismatchError(
            f"vocoder {vocoder_name} was built for mel ({vocoder_mel.describe()}) but the flow produces mel "
            f"({flow_mel.describe()}); a vocoder must be trained on the flow's mel definition")


def slaney_mel_filters(spec: MelSpec) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters, Slaney scale and area normalisation (librosa's default)."""
    return mel_filterbank(spec.sample_rate, spec.n_fft, spec.n_mels, spec.fmin, spec.fmax)


def log_mel(wav: torch.Tensor, spec: MelSpec = CODEC_MEL) -> torch.Tensor:
    """wav [B, samples] at spec.sample_rate -> log mel [B, n_mels, frames] (frames = samples // hop when
    center=False, after the (n_fft - hop) / 2 reflect padding each side)."""
    if spec.center:
        raise ConfigError("only center=False mels are implemented")
    pad = (spec.n_fft - spec.hop) // 2
    x = torch.nn.functional.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    window = torch.hann_window(spec.win, device=wav.device, dtype=wav.dtype)
    stft = torch.stft(x, spec.n_fft, hop_length=spec.hop, win_length=spec.win, window=window, center=False,
                      return_complex=True)
    mag = torch.sqrt(stft.real.pow(2) + stft.imag.pow(2) + 1e-9)  # [B, n_fft//2+1, frames]
    fb = torch.from_numpy(slaney_mel_filters(spec)).to(wav.device, wav.dtype)
    return torch.log(torch.clamp(fb @ mag, min=1e-5))
