"""How often the speech codes change when the encoder sees the reference's whole-segment log-mel instead of ours.

    python3 -m engines.profiling.log_mel_codes WAV [WAV ...] [--preset full-random|mid] [--seed 0]

Ours (engines/speech_in/log_mel.py) is causal: frames before the stream start are zeros, and while a turn streams the
log-mel floor is (running max - 8); at its commit the turn is encoded again with the floor over each whole segment
(engines/speech_in/segment_floor.py). The reference (openai/whisper audio.py, as the codec's feature extractor
computes it) pads the STFT by reflection and floors at (max - 8) over the whole <= 30 s segment. Each file is
encoded with the same random trunk: as streamed, as committed (streamed, then re-encoded), and with the frontend's
frames swapped for the reference's; the codes are compared position by position with the reference's. `mid` is a
narrower trunk (d_model 512, 8 layers) for CPU-only machines.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch

from engines.audio.wav import read_wav
from engines.speech_in.config import EncoderConfig
from engines.speech_in.encoder import SpeechEncoder, _trunk_names
from engines.speech_in.log_mel import MelFrontend
from engines.speech_in.presets import ENCODER_PRESETS
from engines.speech_in.weights import PREFIX, random_state
from engines.speech_out.voice import resample

MID = dataclasses.replace(ENCODER_PRESETS["full-random"], d_model=512, num_heads=8, ffn_dim=2048, num_layers=8,
                          total_layers=8)


def _log_mel(spec: torch.Tensor, frontend: MelFrontend) -> torch.Tensor:
    """[frames, n_mels] log10 mel power of an STFT [n_bins, frames]."""
    return (spec.abs().square().T @ frontend.filters_t.cpu()).clamp_min(1e-10).log10()


def _floored(log_mel: torch.Tensor, peak: torch.Tensor, cfg: EncoderConfig) -> torch.Tensor:
    """Whisper's scaling of log-mel features [frames, n_mels], each frame floored at its (peak - 8) [frames]."""
    return (torch.maximum(log_mel, (peak - cfg.log_mel_range)[:, None]) + 4.0) / 4.0


def reference_log_mel(pcm: np.ndarray, cfg: EncoderConfig, frontend: MelFrontend) -> torch.Tensor:
    """Whisper's features of one segment [frames, n_mels]: centred STFT with reflect padding, |.|^2, mel, log10,
    floor at (segment max - 8), (x + 4) / 4."""
    x = torch.from_numpy(pcm)
    spec = torch.stft(x, cfg.n_fft, cfg.hop_length, window=frontend.window.cpu(), center=True, pad_mode="reflect",
                      return_complex=True)[..., :-1]
    log_mel = _log_mel(spec, frontend)
    return _floored(log_mel, log_mel.max().expand(log_mel.shape[0]), cfg)


def served_log_mel(pcm: np.ndarray, cfg: EncoderConfig, frontend: MelFrontend) -> torch.Tensor:
    """The served features of one segment written out densely [frames, n_mels]: zeros before the stream, floor at
    (running max - 8). Swapped in, they give the served codes: a check of the swap itself."""
    half = cfg.n_fft // 2
    x = torch.cat([torch.zeros(half), torch.from_numpy(pcm), torch.zeros(half)])
    spec = torch.stft(x, cfg.n_fft, cfg.hop_length, window=frontend.window.cpu(), center=False,
                      return_complex=True)[..., : pcm.size // cfg.hop_length]
    log_mel = _log_mel(spec, frontend)
    return _floored(log_mel, torch.cummax(log_mel.amax(dim=1), dim=0).values, cfg)


def whole_segment_log_mel(x: np.ndarray, cfg: EncoderConfig, frontend: MelFrontend) -> torch.Tensor:
    """The features a committed turn is encoded with, written out densely [frames, n_mels] for a stream fed `x`: the
    served frames (zeros before the stream, framed across segment ends), floored at (max - 8) over each 30 s
    segment's frames."""
    half, seg = cfg.n_fft // 2, cfg.mel_per_segment
    spec = torch.stft(torch.from_numpy(np.concatenate([np.zeros(half, np.float32), x])), cfg.n_fft, cfg.hop_length,
                      window=frontend.window.cpu(), center=False, return_complex=True)
    log_mel = _log_mel(spec, frontend)
    peak = torch.cat([torch.full((log_mel[a:a + seg].shape[0],), float(log_mel[a:a + seg].max()))
                      for a in range(0, log_mel.shape[0], seg)])
    return _floored(log_mel, peak, cfg)


def committed_codes(enc: SpeechEncoder, pcm: np.ndarray, streamed: list[int]) -> list[int]:
    """A committed turn's codes as the engine holds them: `streamed` (the turn's stream's), with those the
    whole-segment floor changes in their place."""
    r = enc.refloor(pcm, final=True)
    return streamed if r is None else r.apply(streamed)


def _reference_frames(pcm: np.ndarray, cfg: EncoderConfig, frontend: MelFrontend, features=None) -> torch.Tensor:
    """The reference's frames (or `features`') for every frame the stream can produce (finalize pads the tail with
    silence), segment by segment (the floor is per segment)."""
    seg = cfg.mel_per_segment * cfg.hop_length  # samples per 30 s segment
    padded = np.concatenate([pcm, np.zeros(seg, np.float32)])
    n_seg = -(-pcm.size // seg)
    features = features or reference_log_mel
    return torch.cat([features(padded[i * seg:(i + 1) * seg], cfg, frontend) for i in range(n_seg)]
                     + [torch.zeros(1, cfg.num_mel_bins)])  # a spare row for the padding frame after the last


def encode(enc: SpeechEncoder, pcm: np.ndarray, swap: torch.Tensor | None) -> list[int]:
    """The codes of one stream; `swap`: the features its frames get instead of the frontend's, in frame order."""
    frontend = enc.runner.frontend
    original = frontend.log_mel
    cursor = [0]

    def swapped(samples, first, cell, peak_src, peak_dst, peak_last, peaks, rows, cols):
        out = original(samples, first, cell, peak_src, peak_dst, peak_last, peaks, rows, cols)
        real = (cell < (rows - 1) * cols).nonzero().squeeze(1)  # the stream's row; padding frames sit in the last
        rows_ = swap[cursor[0]:cursor[0] + real.numel()]
        out[real[: rows_.shape[0]]] = rows_.to(out.device, out.dtype)
        cursor[0] += real.numel()
        return out

    if swap is not None:
        frontend.log_mel = swapped
    try:
        s = enc.open_stream()
        return s.push(pcm) + s.finalize()
    finally:
        frontend.log_mel = original


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("wavs", nargs="+")
    p.add_argument("--preset", choices=["full-random", "mid"], default="mid")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = MID if args.preset == "mid" else ENCODER_PRESETS["full-random"]
    enc = _encoder(cfg, args.seed)
    total, differ = 0, [0, 0]
    for path in args.wavs:
        wav, rate = read_wav(path)
        pcm = resample(torch.from_numpy(wav), rate, cfg.sampling_rate).numpy().astype(np.float32)
        streamed = encode(enc, pcm, None)
        committed = committed_codes(enc, pcm, streamed)
        ref = encode(enc, pcm, _reference_frames(pcm, cfg, enc.runner.frontend))
        n = min(len(streamed), len(ref))
        d = [sum(a != b for a, b in zip(ours[:n], ref[:n], strict=True)) for ours in (streamed, committed)]
        first = [i for i in range(n) if committed[i] != ref[i]][:8]
        print(f"{Path(path).name}: {pcm.size / cfg.sampling_rate:.1f} s, {n} codes differ from the reference's:"
              f" streamed {d[0]} ({100 * d[0] / n:.1f}%), committed {d[1]} ({100 * d[1] / n:.1f}%, first at {first})")
        total, differ = total + n, [a + b for a, b in zip(differ, d, strict=True)]
    print(f"all: of {total} codes, streamed {differ[0]} ({100 * differ[0] / max(total, 1):.1f}%) and committed"
          f" {differ[1]} ({100 * differ[1] / max(total, 1):.1f}%) differ, preset {args.preset}")


def _encoder(cfg: EncoderConfig, seed: int) -> SpeechEncoder:
    full = random_state(cfg, seed=seed)
    names = _trunk_names(cfg)
    state = {k[len(PREFIX):]: v for k, v in full.items() if k[len(PREFIX):] in names}
    return SpeechEncoder(cfg, state, torch.device("cpu"), torch.float32)


if __name__ == "__main__":
    main()
