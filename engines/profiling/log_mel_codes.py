"""How often the speech codes change when the encoder sees the reference's whole-segment log-mel instead of ours.

    python3 -m engines.profiling.log_mel_codes WAV [WAV ...] [--preset full-random|mid] [--seed 0]

Ours (engines/speech_in/log_mel.py) is causal: frames before the stream start are zeros, and the log-mel floor is
(running max - 8). The reference (openai/whisper audio.py, as the codec's feature extractor computes it) pads the
STFT by reflection and floors at (max - 8) over the whole <= 30 s segment. Each file is encoded twice with the same
random trunk: once as served, once with the frontend's frames swapped for the reference's, and the codes compared
position by position. `mid` is a narrower trunk (d_model 512, 8 layers) for CPU-only machines.
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


def reference_log_mel(pcm: np.ndarray, cfg: EncoderConfig, frontend: MelFrontend) -> torch.Tensor:
    """Whisper's features of one segment [frames, n_mels]: centred STFT with reflect padding, |.|^2, mel, log10,
    floor at (segment max - 8), (x + 4) / 4."""
    x = torch.from_numpy(pcm)
    spec = torch.stft(x, cfg.n_fft, cfg.hop_length, window=frontend.window.cpu(), center=True, pad_mode="reflect",
                      return_complex=True)[..., :-1]
    log_mel = (spec.abs().square().T @ frontend.filters_t.cpu()).clamp_min(1e-10).log10()
    return (torch.maximum(log_mel, log_mel.max() - cfg.log_mel_range) + 4.0) / 4.0


def served_log_mel(pcm: np.ndarray, cfg: EncoderConfig, frontend: MelFrontend) -> torch.Tensor:
    """The served features of one segment written out densely [frames, n_mels]: zeros before the stream, floor at
    (running max - 8). Swapped in, they give the served codes: a check of the swap itself."""
    half = cfg.n_fft // 2
    x = torch.cat([torch.zeros(half), torch.from_numpy(pcm), torch.zeros(half)])
    spec = torch.stft(x, cfg.n_fft, cfg.hop_length, window=frontend.window.cpu(), center=False,
                      return_complex=True)[..., : pcm.size // cfg.hop_length]
    log_mel = (spec.abs().square().T @ frontend.filters_t.cpu()).clamp_min(1e-10).log10()
    peak = torch.cummax(log_mel.amax(dim=1), dim=0).values
    return (torch.maximum(log_mel, peak[:, None] - cfg.log_mel_range) + 4.0) / 4.0


def _reference_frames(pcm: np.ndarray, cfg: EncoderConfig, frontend: MelFrontend, features=None) -> torch.Tensor:
    """The reference's frames (or `features`') for every frame the stream can produce (finalize pads the tail with
    silence), segment by segment (the floor is per segment)."""
    seg = cfg.max_source_positions * 2 * cfg.hop_length  # samples per 30 s segment
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
        out[real[: rows_.shape[0]]] = rows_.to(out.dtype)
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
    total = differ = 0
    for path in args.wavs:
        wav, rate = read_wav(path)
        pcm = resample(torch.from_numpy(wav), rate, cfg.sampling_rate).numpy().astype(np.float32)
        ours = encode(enc, pcm, None)
        ref = encode(enc, pcm, _reference_frames(pcm, cfg, enc.runner.frontend))
        n = min(len(ours), len(ref))
        d = sum(a != b for a, b in zip(ours[:n], ref[:n], strict=True))
        first = [i for i in range(n) if ours[i] != ref[i]][:8]
        print(f"{Path(path).name}: {pcm.size / cfg.sampling_rate:.1f} s, {n} codes, {d} differ ({100 * d / n:.1f}%),"
              f" first at {first}")
        total, differ = total + n, differ + d
    print(f"all: {differ} of {total} codes differ ({100 * differ / max(total, 1):.1f}%), preset {args.preset}")


def _encoder(cfg: EncoderConfig, seed: int) -> SpeechEncoder:
    full = random_state(cfg, seed=seed)
    names = _trunk_names(cfg)
    state = {k[len(PREFIX):]: v for k, v in full.items() if k[len(PREFIX):] in names}
    return SpeechEncoder(cfg, state, torch.device("cpu"), torch.float32)


if __name__ == "__main__":
    main()
