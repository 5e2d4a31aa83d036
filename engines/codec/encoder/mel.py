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

import numpy as np
import torch

from engines.codec.encoder.config import EncoderConfig
from engines.codec.melscale import mel_filterbank  # noqa: F401  (re-exported for callers of this module)
from engines.host_copy import upload

FFT_ROWS = 64


@dataclass
class MelState:
    """Per-stream frontend state: samples not yet fully framed, and the running log-mel peak."""

    buf: np.ndarray  # [n] float32 (host): stream samples from the start of the next frame on
    peak: torch.Tensor  # [] float32: running max of log10 mel power (kept on device: no host sync)
    frames_done: int = 0
    samples_seen: int = 0


class MelFrontend:
    """Turns PCM pieces of many streams into log-mel frames with one FFT and one matmul.

    Per stream, only host work (its samples kept until framed) and tensor views: the kernels run once for all
    streams, so a step's launches do not grow with the streams in it."""

    def __init__(self, cfg: EncoderConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.window = torch.hann_window(cfg.n_fft, periodic=True, dtype=torch.float32, device=device)
        self.offsets = torch.arange(cfg.n_fft, device=device)  # a frame's samples from its first
        fb = mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.num_mel_bins)
        self.filters_t = torch.from_numpy(fb.T.copy()).to(device)  # [n_bins, n_mels]

    def new_state(self) -> MelState:
        # Frame 0 starts n_fft/2 samples before the stream: those are the zero padding.
        return MelState(buf=np.zeros(self.cfg.n_fft // 2, dtype=np.float32),
                        peak=torch.full((), float("-inf"), dtype=torch.float32, device=self.device))

    def frames(self, states: list[MelState], pcms: list[np.ndarray]) -> list[torch.Tensor]:
        """Append each stream's new samples (float32 host arrays, as the encoder's `_as_pcm` checks them); return
        each stream's newly complete frames [n_i, n_mels] (views of one tensor)."""
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_length
        bufs: list[np.ndarray] = []
        counts: list[int] = []
        for st, pcm in zip(states, pcms, strict=True):
            buf = np.concatenate([st.buf, pcm]) if pcm.size else st.buf
            st.samples_seen += int(pcm.size)
            n = 0 if buf.size < n_fft else (buf.size - n_fft) // hop + 1
            counts.append(n)
            bufs.append(buf)
            st.buf = buf[n * hop:].copy() if n else buf
            st.frames_done += n
        n_frames = sum(counts)
        if not n_frames:
            return [torch.zeros(0, self.cfg.num_mel_bins, device=self.device) for _ in states]
        # The samples of the streams with new frames go up as they are; the frames are gathered from them on the
        # device (a frame is 2.5x its hop: framing on the host made and copied 2.5x the data, ~6 ms for 150 streams
        # of 0.32 s). cuFFT builds a plan per batch size: padded to a multiple of FFT_ROWS, a few plans serve every
        # load (a new plan mid-serving stalls the engine loop); padding rows frame the first samples.
        n_arr = np.asarray(counts, dtype=np.int64)
        active = np.flatnonzero(n_arr)
        lengths = np.asarray([bufs[b].size for b in active], dtype=np.int64)
        j = np.arange(n_frames) - np.repeat(np.cumsum(n_arr) - n_arr, n_arr)  # [N] each frame's number in its stream
        first = np.zeros(n_frames + (-n_frames % FFT_ROWS), dtype=np.int64)  # [N padded] its first sample
        first[:n_frames] = np.repeat(np.cumsum(lengths) - lengths, n_arr[active]) + j * hop
        n_max = max(counts)
        # Causal version of Whisper's clamp to (max - 8): the peak is the max over the stream's frames so far,
        # a running max along each stream's row of a [streams, n_max] layout (padding -inf).
        row = np.repeat(np.arange(active.size), n_arr[active])
        (samples,) = upload([np.concatenate([bufs[b] for b in active.tolist()])], self.device, torch.float32)
        first_t, row_t, col_t, rows_t, last_t = upload([first, row, j, np.arange(active.size), n_arr[active] - 1],
                                                       self.device)
        frames = samples[first_t[:, None] + self.offsets]  # [N padded, n_fft]
        spec = torch.fft.rfft(frames * self.window, dim=-1)[:n_frames]  # [N, n_bins]
        power = spec.real.square() + spec.imag.square()
        log_mel = (power @ self.filters_t).clamp_min(1e-10).log10()  # [N, n_mels]
        grid = torch.full((active.size, n_max), float("-inf"), device=self.device)
        grid[row_t, col_t] = log_mel.amax(dim=1)
        grid = torch.maximum(torch.cummax(grid, dim=1).values,
                             torch.stack([states[b].peak for b in active.tolist()])[:, None])
        floor = grid[row_t, col_t] - self.cfg.log_mel_range  # [N]
        out_all = (torch.maximum(log_mel, floor[:, None]) + 4.0) / 4.0
        for b, peak in zip(active.tolist(), grid[rows_t, last_t].unbind(), strict=True):
            states[b].peak = peak
        return list(out_all.split(counts))
