"""Whisper-style 128-bin log-mel at 16 kHz, computed causally so it can run on PCM arriving in pieces.

Whisper frames its STFT with center=True (reflect padding, frame t centred on sample 160 t). Here frame t
covers the samples [160 t - 200, 160 t + 200) of the stream, samples before the stream start being zeros:
the same centring, zero instead of reflect padding at the very start, and no right padding, so a frame is
computed exactly once, as soon as its last sample has arrived.

Whisper's normalisation clamps each utterance to (its max - 8) in log10 units, a max over the whole
utterance, which a stream cannot know. We use the running max over the frames seen so far (per stream):
the same floor once the loudest frame has passed; quieter frames before it are floored lower than
Whisper would. Both streaming and whole-utterance encoding here use this same causal rule. A stream may start
from a given peak instead (`MelState.peak`): with each 30 s segment's max given, the floor is Whisper's
(segment_floor.py re-encodes a committed turn so).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engines.audio.melscale import mel_filterbank  # noqa: F401  (re-exported for callers of this module)
from engines.speech_in.config import EncoderConfig

FFT_ROWS = 64


@dataclass
class MelState:
    """Per-stream frontend state on the host: samples not yet fully framed. (Its running log-mel peak is on the device,
    in the KV pool's state rows: slot_pool.py.)"""

    buf: np.ndarray  # [n] float32: stream samples from the start of the next frame on
    frames_done: int = 0
    samples_seen: int = 0
    peak: float | None = None  # the running peak before its first frame (None: -inf), written by its first step


@dataclass
class MelPlan:
    """A step's new frames on the host: what `MelFrontend.plan` framed."""

    counts: np.ndarray  # [streams] new frames of each stream
    samples: np.ndarray  # float32: the samples those frames cover, stream by stream
    starts: np.ndarray  # [streams] each stream's first sample in `samples`
    fresh: np.ndarray  # [streams] bool: no frame before these (the running peak starts at -inf)
    more: bool  # some stream has more complete frames than its limit let through


class MelFrontend:
    """Turns PCM pieces of many streams into log-mel frames with one FFT and one matmul.

    `plan` keeps each stream's samples on the host until framed; `log_mel` computes every stream's new frames at once
    from index arrays (the step's kernels do not grow with its streams, and they can be replayed as a CUDA graph)."""

    def __init__(self, cfg: EncoderConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.window = torch.hann_window(cfg.n_fft, periodic=True, dtype=torch.float32, device=device)
        self.offsets = torch.arange(cfg.n_fft, device=device)  # a frame's samples from its first
        fb = mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.num_mel_bins)
        self.filters_t = torch.from_numpy(fb.T.copy()).to(device)  # [n_bins, n_mels]

    def new_state(self) -> MelState:
        # Frame 0 starts n_fft/2 samples before the stream: those are the zero padding.
        return MelState(buf=np.zeros(self.cfg.n_fft // 2, dtype=np.float32))

    def plan(self, states: list[MelState], pcms: list[np.ndarray], limits: np.ndarray) -> MelPlan:
        """Append each stream's new samples (float32 host arrays, as the encoder's `_as_pcm` checks them) and frame at
        most `limits` of its complete frames (the rest stay for the next plan)."""
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_length
        parts: list[np.ndarray] = []
        counts = np.zeros(len(states), dtype=np.int64)
        fresh = np.asarray([st.frames_done == 0 and st.peak is None for st in states], dtype=bool)
        more = False
        for i, (st, pcm, limit) in enumerate(zip(states, pcms, limits.tolist(), strict=True)):
            buf = np.concatenate([st.buf, pcm]) if pcm.size else st.buf
            st.samples_seen += int(pcm.size)
            avail = 0 if buf.size < n_fft else (buf.size - n_fft) // hop + 1
            n = min(avail, limit)
            more |= avail > n
            if n:
                parts.append(buf[: (n - 1) * hop + n_fft])  # the samples of its n frames
                buf = buf[n * hop:].copy()
            st.buf = buf
            st.frames_done += n
            counts[i] = n
        lengths = np.where(counts > 0, (counts - 1) * hop + n_fft, 0)
        samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return MelPlan(counts, samples, np.cumsum(lengths) - lengths, fresh, more)

    def raw_log_mel(self, samples: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """[frames, n_mels] log10 mel power of the frames starting at samples[first], before the floor."""
        frames = samples[first[:, None] + self.offsets]  # [frames, n_fft]
        spec = torch.fft.rfft(frames * self.window, dim=-1)  # [frames, n_bins]
        power = spec.real.square() + spec.imag.square()
        return (power @ self.filters_t).clamp_min(1e-10).log10()

    def log_mel(self, samples: torch.Tensor, first: torch.Tensor, cell: torch.Tensor, peak_src: torch.Tensor,
                peak_dst: torch.Tensor, peak_last: torch.Tensor, peaks: torch.Tensor, rows: int, cols: int
                ) -> torch.Tensor:
        """[frames, n_mels] normalised log-mel of the frames starting at samples[first]. Whisper clamps to (max - 8);
        causally the max is a running max per stream: each frame's value goes to its `cell` of a [rows, cols] grid
        (a stream's frames along its row; padding frames to a row of their own), whose running max along rows, from
        each row's previous peak (peaks[peak_src]), floors the frames; each row's last cell is its new peak
        (peaks[peak_dst], from peak_last)."""
        log_mel = self.raw_log_mel(samples, first)
        grid = torch.full((rows * cols,), float("-inf"), device=samples.device)
        grid.index_put_((cell,), log_mel.amax(dim=1))
        grid = torch.maximum(torch.cummax(grid.view(rows, cols), dim=1).values, peaks[peak_src][:, None]).view(-1)
        peaks[peak_dst] = grid[peak_last]
        floor = grid[cell] - self.cfg.log_mel_range  # [frames]
        return (torch.maximum(log_mel, floor[:, None]) + 4.0) / 4.0
