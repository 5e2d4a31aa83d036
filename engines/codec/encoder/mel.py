"""Whisper-style 128-bin log-mel at 16 kHz, computed causally so it can run on PCM arriving in pieces.

Whisper frames its STFT with center=True (reflect padding, frame t centred on sample 160 t). Here frame t
covers the samples [160 t - 200, 160 t + 200) of the stream, samples before the stream start being zeros:
the same centring, zero instead of reflect padding at the very start, and no right padding, so a frame is
computed exactly once, as soon as its last sample has arrived.

Whisper's normalisation clamps each utterance to (its max - 8) in log10 units, a max over the whole
utterance, which a stream cannot know. We use the running max over the frames seen so far (per stream):
the same floor once the loudest frame has passed; quieter frames before it are floored lower than
Whisper would. Both streaming and whole-utterance encoding here use this same causal rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.codec.encoder.config import EncoderConfig
from engines.codec.melscale import mel_filterbank  # noqa: F401  (re-exported for callers of this module)

FFT_ROWS = 64


@dataclass
class MelState:
    """Per-stream frontend state: samples not yet fully framed, and the running log-mel peak."""

    buf: torch.Tensor  # [n] float32: stream samples from the start of the next frame on
    peak: torch.Tensor  # [] float32: running max of log10 mel power (kept on device: no host sync)
    frames_done: int = 0
    samples_seen: int = 0


class MelFrontend:
    """Turns PCM pieces of many streams into log-mel frames with one FFT and one matmul."""

    def __init__(self, cfg: EncoderConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.window = torch.hann_window(cfg.n_fft, periodic=True, dtype=torch.float32, device=device)
        fb = mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.num_mel_bins)
        self.filters_t = torch.from_numpy(fb.T.copy()).to(device)  # [n_bins, n_mels]

    def new_state(self) -> MelState:
        # Frame 0 starts n_fft/2 samples before the stream: those are the zero padding.
        return MelState(buf=torch.zeros(self.cfg.n_fft // 2, dtype=torch.float32, device=self.device),
                        peak=torch.full((), float("-inf"), dtype=torch.float32, device=self.device))

    def frames(self, states: list[MelState], pcms: list[torch.Tensor]) -> list[torch.Tensor]:
        """Append each stream's new samples; return each stream's newly complete frames [n_i, n_mels]."""
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_length
        windows: list[torch.Tensor] = []
        counts: list[int] = []
        for st, pcm in zip(states, pcms, strict=True):
            st.buf = torch.cat([st.buf, pcm.to(self.device, torch.float32)])
            st.samples_seen += int(pcm.numel())
            n = 0 if st.buf.numel() < n_fft else (st.buf.numel() - n_fft) // hop + 1
            counts.append(n)
            if n:
                windows.append(st.buf.unfold(0, n_fft, hop)[:n])  # [n, n_fft]
                st.buf = st.buf[n * hop:]
                st.frames_done += n
        if not windows:
            return [torch.zeros(0, self.cfg.num_mel_bins, device=self.device) for _ in states]
        frames = torch.cat(windows) * self.window  # [N, n_fft]
        n_frames = frames.shape[0]
        # cuFFT builds a plan per batch size: padded to a multiple of FFT_ROWS, a few plans serve every load
        # (a new plan mid-serving stalls the engine loop).
        frames = torch.nn.functional.pad(frames, (0, 0, 0, -n_frames % FFT_ROWS))
        spec = torch.fft.rfft(frames, dim=-1)[:n_frames]  # [N, n_bins]
        power = spec.real.square() + spec.imag.square()
        log_mel = (power @ self.filters_t).clamp_min(1e-10).log10()  # [N, n_mels]
        out: list[torch.Tensor] = []
        start = 0
        for st, n in zip(states, counts, strict=True):
            lm = log_mel[start:start + n]
            start += n
            if n == 0:
                out.append(lm)
                continue
            # Causal version of Whisper's clamp to (max - 8): the peak is the max over frames so far.
            peak = torch.maximum(torch.cummax(lm.amax(dim=1), dim=0).values, st.peak)  # [n]
            st.peak = peak[-1]
            lm = torch.maximum(lm, (peak - self.cfg.log_mel_range)[:, None])
            out.append((lm + 4.0) / 4.0)
        return out
