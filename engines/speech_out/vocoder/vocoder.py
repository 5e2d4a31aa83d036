"""mel -> 24 kHz PCM behind one interface, streamed in overlapping windows with crossfaded seams.

Each chunk's mel is vocoded together with the last `voc_ctx_frames` frames before it (left context). The
last `crossfade_frames` of every window are held back: they lack right context, so the next window renders
them again and the two renderings are crossfaded (Hann ramps). `finalize` releases the held tail. Output
length is exactly frames x hop samples.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from engines.speech_out.config import BigVGANConfig, HiFTConfig, StreamConfig
from engines.speech_out.mel_spec import SILENCE_LOG_MEL, MelSpec
from engines.speech_out.vocoder.hift import HiFTGenerator


@dataclass
class VocoderState:
    ctx_mel: torch.Tensor  # [80, M] left context for the next window
    tail: np.ndarray | None = None  # [X] held-back samples of the previous window (float32)
    phase: torch.Tensor | None = None  # [H] HiFT harmonic phases (cycles) at the next window start


class Vocoder(nn.Module):
    """Base: subclasses implement `render(mel, states, gens, keep_at)` -> wav [B, T * hop]."""

    name = "vocoder"
    mel: MelSpec

    def init_state(self, prompt_mel: torch.Tensor, ctx: int, gen: torch.Generator) -> VocoderState:
        dev, dt = prompt_mel.device, prompt_mel.dtype
        ctx_mel = torch.full((self.mel.n_mels, ctx), SILENCE_LOG_MEL, device=dev, dtype=dt)
        n = min(ctx, prompt_mel.shape[1])
        if n:
            ctx_mel[:, ctx - n:] = prompt_mel[:, -n:]
        return VocoderState(ctx_mel)

    def render(self, mel: torch.Tensor, states: list[VocoderState], gens: list[torch.Generator], keep_at: int
               ) -> torch.Tensor:
        raise NotImplementedError

    def fold_weight_norm(self) -> None:
        raise NotImplementedError


class HiFTVocoder(Vocoder):
    name = "hift"

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.mel = cfg.mel
        self.generator = HiFTGenerator(cfg)
        self.graphs = None  # VocoderGraphs when CUDA graphs are enabled (CodecDecoder.load(cuda_graphs=True))

    def fold_weight_norm(self) -> None:
        self.generator.fold_weight_norm()

    def init_state(self, prompt_mel, ctx, gen):
        st = super().init_state(prompt_mel, ctx, gen)
        # Every harmonic starts at phase zero (engines/speech_out/vocoder/hift.py says why).
        st.phase = torch.zeros(self.generator.n_harmonics, device=prompt_mel.device, dtype=prompt_mel.dtype)
        return st

    def noise(self, gens: list[torch.Generator], frames: int, device, dtype) -> torch.Tensor:
        """The source noise of one window per session, from each session's own generator: [B, H, frames * hop]."""
        H, S = self.generator.n_harmonics, frames * self.mel.hop
        return torch.stack([torch.randn(H, S, generator=g, device=device, dtype=dtype) for g in gens])

    def render(self, mel, states, gens, keep_at):
        inputs = [mel, torch.stack([s.phase for s in states]), self.noise(gens, mel.shape[2], mel.device, mel.dtype)]
        if self.graphs is not None and mel.device.type == "cuda":
            wav, nxt = self.graphs.run(inputs, (keep_at,))
        else:
            wav, nxt = self.generator(*inputs, keep_at)
        for b, s in enumerate(states):
            s.phase = nxt[b]
        return wav


class BigVGANVocoder(Vocoder):
    """The `bigvgan` package's generator configured for the codec mel. No sampling, so no RNG use."""

    name = "bigvgan"

    def __init__(self, cfg: BigVGANConfig) -> None:
        super().__init__()
        from bigvgan.bigvgan import BigVGAN  # lazy: only this vocoder needs the package
        from bigvgan.env import AttrDict

        self.mel = cfg.mel
        with warnings.catch_warnings():  # the package uses the deprecated weight_norm API; nothing to act on
            warnings.simplefilter("ignore", FutureWarning)
            self.generator = BigVGAN(AttrDict(cfg.h_params()), use_cuda_kernel=False)

    def fold_weight_norm(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # the package prints a line here
            self.generator.remove_weight_norm()

    def render(self, mel, states, gens, keep_at):
        return self.generator(mel)[:, 0]


def crossfade_windows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hann fade-in and fade-out ramps of n samples that sum to one (float32)."""
    w = torch.hann_window(2 * n, periodic=False, dtype=torch.float64)[:n]
    fade_in = (w / (w + w.flip(0))).float()
    return fade_in.numpy(), (1 - fade_in).numpy()


class Rendered(NamedTuple):
    """WindowedVocoder.render's windows on the host [B, samples] (float32; pinned and filled by a queued copy on
    CUDA) and the new frames F behind each."""

    wav: torch.Tensor
    frames: int


class WindowedVocoder:
    """Streams a Vocoder: left mel context, held tail and crossfade per session."""

    def __init__(self, vocoder: Vocoder, stream: StreamConfig) -> None:
        self.vocoder, self.stream = vocoder, stream
        self.hop = vocoder.mel.hop
        self.hold = stream.crossfade_frames * self.hop
        self.fade_in, self.fade_out = crossfade_windows(self.hold)

    def new_state(self, prompt_mel: torch.Tensor, gen: torch.Generator) -> VocoderState:
        return self.vocoder.init_state(prompt_mel, self.stream.voc_ctx_frames, gen)

    @torch.inference_mode()
    def render(self, mel: torch.Tensor, states: list[VocoderState], gens: list[torch.Generator]) -> Rendered:
        """Queue the vocoder on mel [B, 80, F] new frames (each after its session's left context) and the copy of its
        windows to the host, valid once the current stream's work is done; then `finish`. Every session's left
        context moves on now."""
        M, hop = self.stream.voc_ctx_frames, self.hop
        Fr = mel.shape[2]
        win = torch.cat([torch.stack([s.ctx_mel for s in states]), mel], dim=2)  # [B, 80, M + F]
        # Next window starts F frames later: that is where the carried state must point.
        wav = self.vocoder.render(win, states, gens, keep_at=Fr * hop).float()
        for b, s in enumerate(states):
            s.ctx_mel = win[b, :, -M:]
        if not wav.is_cuda:
            return Rendered(wav, Fr)
        # Into pinned memory, queued behind the vocoder: the caller's one wait covers it (a copy to pageable memory
        # would be a second, synchronous transfer after the wait).
        host = torch.empty(wav.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(wav, non_blocking=True)
        return Rendered(host, Fr)

    def finish(self, r: Rendered, states: list[VocoderState], final: list[bool]) -> list[np.ndarray]:
        """`render`'s windows (once the stream's work is done) -> per session the PCM that is now final (float32
        [samples]). One device -> host copy per batch; seams are cut and crossfaded on the host, in numpy (a few us per
        session, where torch's CPU ops took ~5 us each)."""
        M, hop, X = self.stream.voc_ctx_frames, self.hop, self.hold
        y_all = r.wav.numpy()  # [B, >= (M + F) * hop]
        start, end = M * hop - X, (M + r.frames) * hop
        # Every window's seam faded in at once; a session without a tail (its first window) starts after it.
        seams = y_all[:, start:start + X] * self.fade_in  # [B, X]
        out = []
        for b, s in enumerate(states):
            y = y_all[b]
            body = y[start + X:end if final[b] else end - X]
            # (copies, never views of `wav`: a pinned buffer goes back to the allocator's cache once unused)
            out.append(np.concatenate([s.tail * self.fade_out + seams[b], body]) if s.tail is not None else body.copy())
            s.tail = None if final[b] else y[end - X:end].copy()
        return out
