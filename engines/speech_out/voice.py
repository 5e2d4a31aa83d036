"""Speaker prompt: prompt codes + prompt 80-bin mel (24 kHz, 4 frames per code) + 192-d CAM++ x-vector.

A voice is computed once and cached by the decoder (by name). Sources:
- `Voice.random(seed, ...)`: the built-in voice of random presets (fixed random codes, mel and x-vector).
- `Voice.from_wav(path or bytes, encode=..., campplus=...)`: a recording. Its codes come from the speech encoder
  (passed in as a callable, it lives in engines/speech_in), its x-vector from `campplus.onnx`
  (onnxruntime, imported lazily) on 80-bin Kaldi-style fbank features at 16 kHz; the prompt is its first aligned
  part (`aligned_prompt`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engines.audio.voice_prompt import check_voice_prompt
from engines.audio.wav import AudioFormatError, read_wav
from engines.config import ConfigError
from engines.speech_out.mel_spec import CODEC_MEL, log_mel

# The voice answers speak in when a session sets none (the engine's --voice chooses another): eSpeak NG speech,
# dedicated to the public domain (CC0); docs/operations.md, Voice.
DEFAULT_VOICE_WAV = Path(__file__).resolve().parent / "voices" / "default.wav"
# Its prompt codes (5.86 s at 12.5 a second): what benches give their sessions' random voices, so that every chunk
# reads as many prompt keys as a served answer in the default voice.
BUNDLED_VOICE_CODES = 73


@dataclass(frozen=True, eq=False)
class Voice:
    name: str
    codes: torch.Tensor  # [P] long, 0..16383
    mel: torch.Tensor  # [80, 4P] float32 log mel (codec mel definition)
    xvector: torch.Tensor  # [192] float32

    def __post_init__(self) -> None:
        if self.codes.dim() != 1 or self.mel.dim() != 2 or self.xvector.dim() != 1:
            raise ConfigError(f"voice {self.name}: codes [P], mel [80, 4P], xvector [192] expected")
        if self.mel.shape[1] != 4 * self.codes.shape[0]:
            raise ConfigError(f"voice {self.name}: mel has {self.mel.shape[1]} frames for {self.codes.shape[0]} "
                              f"codes (need 4 per code)")

    @classmethod
    def empty(cls, n_mels: int = 80, spk_dim: int = 192) -> Voice:
        """No prompt: the flow starts from silence context and a zero x-vector."""
        return cls("empty", torch.zeros(0, dtype=torch.long), torch.zeros(n_mels, 0), torch.zeros(spk_dim))

    @classmethod
    def random(cls, seed: int = 0, n_codes: int = 25, n_mels: int = 80, spk_dim: int = 192) -> Voice:
        g = torch.Generator().manual_seed(seed)
        codes = torch.randint(0, 16384, (n_codes,), generator=g)
        # A plausible log-mel level (speech sits around -6..-2) with some spectral/temporal variation.
        mel = -5.0 + 1.5 * torch.randn(n_mels, 4 * n_codes, generator=g)
        # The decoder caches voices by name: every argument that changes the voice is in it.
        return cls(f"random-{seed}-{n_codes}-{n_mels}-{spk_dim}", codes, mel, torch.randn(spk_dim, generator=g))

    @classmethod
    def from_wav(cls, source: str | Path | bytes, *, encode: Callable[[np.ndarray], Sequence[int]],
                 campplus: str | Path | None, max_codes: int = 375, name: str | None = None) -> Voice:
        """A WAV file (a path or its bytes) within the prompt bounds (engines/audio/voice_prompt.py; ConfigError
        saying why not). encode: 16 kHz float32 mono -> 12.5 Hz codes. campplus: path to campplus.onnx (None: zero
        x-vector)."""
        try:
            check_voice_prompt(source)
            samples, sr = read_wav(source)
        except AudioFormatError as e:
            raise ConfigError(str(e)) from None
        wav = torch.from_numpy(samples)
        w16 = resample(wav, sr, 16000)
        w24 = resample(wav, sr, CODEC_MEL.sample_rate)
        codes = torch.as_tensor(list(encode(w16.numpy())), dtype=torch.long)
        mel = log_mel(w24[None], CODEC_MEL)[0]
        codes, mel = aligned_prompt(codes, mel, max_codes)
        xvec = campplus_xvector(w16, campplus) if campplus is not None else torch.zeros(192)
        return cls(name or ("wav" if isinstance(source, bytes | bytearray) else str(source)), codes, mel.float(), xvec)


def aligned_prompt(codes: torch.Tensor, mel: torch.Tensor, max_codes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's first aligned part, as the codec's reference frontend keeps it (MOSS-Speech-decoder-cosy,
    whisper_encoder_decoder.py, after CosyVoice2's frontend with its 2 mel frames per 25 Hz token): n = min(mel
    frames // 4, codes) codes and their 4 n mel frames from the start (a code covers 80 ms, a frame 20 ms), capped
    at `max_codes`."""
    n = min(int(mel.shape[1]) // 4, int(codes.shape[0]), max_codes)
    return codes[:n], mel[:, :4 * n]


def resample(x: torch.Tensor, sr_in: int, sr_out: int) -> torch.Tensor:
    """Band-limited resampling through the spectrum (fine for prompts; not a streaming resampler)."""
    if sr_in == sr_out or x.numel() == 0:
        return x
    n_out = int(round(x.shape[-1] * sr_out / sr_in))
    spec = torch.fft.rfft(x.double())
    keep = min(spec.shape[-1], n_out // 2 + 1)
    out = torch.zeros(n_out // 2 + 1, dtype=spec.dtype)
    out[:keep] = spec[:keep]
    return (torch.fft.irfft(out, n=n_out) * (n_out / x.shape[-1])).float()


def kaldi_fbank(wav16: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """Kaldi-style log mel filterbank (25 ms Povey window, 10 ms shift, pre-emphasis 0.97, DC removal, HTK mel
    20 Hz..8 kHz, power spectrum) on 16 kHz audio scaled to int16 range -> [frames, n_mels]."""
    x = wav16.double() * 32768.0
    flen, shift, nfft = 400, 160, 512
    if x.numel() < flen:
        raise ConfigError("voice recording shorter than 25 ms")
    frames = x.unfold(0, flen, shift)  # [T, 400] (snip edges)
    frames = frames - frames.mean(dim=1, keepdim=True)
    frames = torch.cat([frames[:, :1] * (1 - 0.97), frames[:, 1:] - 0.97 * frames[:, :-1]], dim=1)
    povey = torch.hann_window(flen, periodic=False, dtype=torch.float64).pow(0.85)
    power = torch.fft.rfft(frames * povey, n=nfft).abs().pow(2)  # [T, 257]

    def mel(f):
        return 1127.0 * np.log(1.0 + np.asarray(f) / 700.0)

    lo, hi = mel(20.0), mel(8000.0)
    centers = np.linspace(lo, hi, n_mels + 2)
    fft_mel = mel(np.arange(nfft // 2 + 1) * 16000 / nfft)
    left, mid, right = centers[:-2, None], centers[1:-1, None], centers[2:, None]
    banks = np.maximum(0.0, np.minimum((fft_mel - left) / (mid - left), (right - fft_mel) / (right - mid)))
    fb = power @ torch.from_numpy(banks).T
    return torch.log(fb.clamp(min=np.finfo(np.float32).eps)).float()


def campplus_xvector(wav16: torch.Tensor, onnx_path: str | Path) -> torch.Tensor:
    """192-d speaker embedding from campplus.onnx (input: mean-normalised fbank [1, T, 80])."""
    try:
        import onnxruntime  # lazy: only voices from recordings need it
    except ImportError as e:
        raise ConfigError("onnxruntime is required to compute an x-vector from campplus.onnx") from e
    if not Path(onnx_path).is_file():
        raise ConfigError(f"campplus model {onnx_path} does not exist")
    feat = kaldi_fbank(wav16)
    feat = feat - feat.mean(dim=0, keepdim=True)
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = onnxruntime.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    out = sess.run(None, {sess.get_inputs()[0].name: feat[None].numpy()})[0]
    vec = torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(-1))
    if vec.numel() != 192 or not math.isfinite(float(vec.abs().sum())):
        raise ConfigError(f"{onnx_path}: expected a finite 192-d x-vector, got {vec.numel()} values")
    return vec
