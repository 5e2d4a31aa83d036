"""Slaney mel scale and filterbank, shared by the speech encoder (Whisper features) and the codec decoder."""

from __future__ import annotations

import numpy as np

_F_SP = 200.0 / 3  # Slaney mel scale: linear below 1 kHz...
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOG_STEP = np.log(6.4) / 27.0  # ...logarithmic above


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    return np.where(f >= _MIN_LOG_HZ, _MIN_LOG_MEL + np.log(np.maximum(f, 1e-12) / _MIN_LOG_HZ) / _LOG_STEP,
                    f / _F_SP)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= _MIN_LOG_MEL, _MIN_LOG_HZ * np.exp(_LOG_STEP * (m - _MIN_LOG_MEL)), m * _F_SP)


def mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters (what Whisper's feature extractor uses).

    Returns float32 [n_mels, n_fft // 2 + 1].
    """
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0.0, sr / 2, n_fft // 2 + 1)
    mel_pts = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))  # [n_mels + 2] Hz
    widths = np.diff(mel_pts)  # [n_mels + 1]
    ramps = mel_pts[:, None] - fft_freqs[None, :]  # [n_mels + 2, n_bins]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))  # [n_mels, n_bins]
    weights *= (2.0 / (mel_pts[2:] - mel_pts[:-2]))[:, None]  # equal area per filter
    return weights.astype(np.float32)
