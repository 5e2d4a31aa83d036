"""HiFT vocoder (neural source filter + iSTFT head), the codec's own `flow/hift.pt`.

Key layout: `f0_predictor.condnet.{0,2,4,6,8}` (weight-normed convs, ELU between) + `f0_predictor.classifier`,
`m_source.l_linear`, `conv_pre`, `ups.N`, `source_downs.N` (plain convs), `source_resblocks.N`, `resblocks.N`
(`convs1/convs2.M` weight-normed, `activations1/2.M.alpha` Snake), `conv_post`. Weight norm is accepted both as
`weight_g/weight_v` and as `parametrizations.weight.original0/1`, and folded into plain weights after loading.

Streaming differences from a one-shot call: the harmonic phases start from a per-session carried phase (so
overlapping windows share the same sine source; a session starts every harmonic at phase zero, which is what the
reference's random initial overtone phase amounts to at hop 480, since it is added to the first sample only and the
frame-rate phase never reads that sample) and all noise comes from the session's generator. The generator
takes that noise as an input (`HiFTVocoder.render` draws it), so its forward is deterministic and can be replayed
as a CUDA graph (engines/speech_out/chunk_graphs.py) with the same result as eager. The Snake kernel
(engines/kernels/speech_out/snake.py) is imported inside the CUDA branches: they need Triton, which a CPU-only machine
may lack.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engines.cuda.precision import float32_matmuls
from engines.cuda.streams import side_by_side
from engines.lm.step_graphs import SideStreams
from engines.speech_out.config import HiFTConfig
from engines.speech_out.derived import weights_key


def _pad(k: int, d: int) -> int:
    return (k * d - d) // 2


def istft(spec: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor) -> torch.Tensor:
    """spec [B, n_fft // 2 + 1, N] complex -> [B, (N - 1) * hop]: torch.istft(center=True) as irfft + overlap-add.
    torch.istft checks the window envelope with a host sync, which a CUDA graph capture refuses; the periodic Hann
    window with hop < n_fft never fails that check, so this skips it."""
    N = spec.shape[2]
    L = n_fft + hop * (N - 1)
    frames = torch.fft.irfft(spec, n=n_fft, dim=1) * window[:, None]  # [B, n_fft, N]
    y = F.fold(frames, (1, L), (1, n_fft), stride=(1, hop))[:, 0, 0]  # [B, L]
    env = F.fold((window * window)[None, :, None].expand(1, n_fft, N), (1, L), (1, n_fft), stride=(1, hop))[0, 0, 0]
    c = n_fft // 2
    return y[:, c:L - c] / env[c:L - c]


def conv(m: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """m(x) for x [B, C, T] (without m's bias when `bias` is False). On CUDA as a channels-last 2-D conv over
    [B, C, 1, T], which takes time-major x ([B, T, C] in memory) as it is and returns [B, C', T'] time-major: a stack
    of these passes its activations from conv to conv with no layout transform, where cuDNN's NHWC kernels otherwise
    run behind an NCHW <-> NHWC transform around each conv (162 of HiFT's 453 kernels at batch 1; codec steps on an
    H100 at batch 1 13.45 -> 13.34 ms, 16 30.02 -> 29.86; 2026-12-01). cuDNN's choice of algorithm differs
    from the 1-D call's, so the two layouts agree to TF32 rounding, not bit for bit."""
    b = m.bias if bias else None
    transposed = isinstance(m, nn.ConvTranspose1d)
    if not x.is_cuda:
        if transposed:
            return F.conv_transpose1d(x, m.weight, b, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
        return m._conv_forward(x, m.weight, b)
    w = _weight_2d(m)
    x4 = x.unsqueeze(2)  # [B, C, 1, T]; channels-last when x is time-major (else cuDNN converts it, once)
    if transposed:
        y = F.conv_transpose2d(x4, w, b, (1, m.stride[0]), (0, m.padding[0]), (0, m.output_padding[0]), m.groups,
                               (1, m.dilation[0]))
    else:
        y = F.conv2d(x4, w, b, (1, m.stride[0]), (0, m.padding[0]), (1, m.dilation[0]), m.groups)
    return y.squeeze(2)


def _weight_2d(m: nn.Conv1d | nn.ConvTranspose1d) -> torch.Tensor:
    """m's weight as a channels-last 2-D conv weight [*, *, 1, K], cached on m until a weight changes (HiFT's convs
    hold these copies, ~70 MB for the full-size generator, from its first call on CUDA)."""
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        raise ValueError(f"conv takes zero padding given as sizes, got {m.padding_mode} {m.padding}")
    key = weights_key(m)
    cached = getattr(m, "_weight_2d", None)
    if cached is None or cached[0] != key:
        cached = (key, m.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last))
        m._weight_2d = cached
    return cached[1]


class Snake(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.float32:  # one kernel instead of torch's seven
            from engines.kernels.speech_out.snake import snake

            return snake(x, self.alpha)  # one kernel, the same bits
        a = self.alpha[None, :, None]
        return x + (1.0 / (a + 1e-9)) * torch.sin(a * x).pow(2)


class ResBlock(nn.Module):
    def __init__(self, ch: int, k: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(weight_norm(nn.Conv1d(ch, ch, k, dilation=d, padding=_pad(k, d)))
                                    for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(nn.Conv1d(ch, ch, k, padding=_pad(k, 1))) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(ch) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(ch) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.float32:
            return self._forward_fused(x)
        return self._forward_reference(x)

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
            x = x + conv(c2, a2(conv(c1, a1(x))))
        return x

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The reference's arithmetic with each conv's bias add, and the residual add, in the Snake kernel after
        it (engines/kernels/speech_out/snake.py): per dilation 2 elementwise kernels instead of 5, the same bits."""
        from engines.kernels.speech_out.snake import add_snake, snake

        n = len(self.convs1)
        s = snake(x, self.activations1[0].alpha)
        for i, (c1, c2) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            h = snake(conv(c1, s, bias=False), self.activations2[i].alpha, c1.bias)
            nxt = self.activations1[i + 1].alpha if i + 1 < n else None
            x, s = add_snake(conv(c2, h, bias=False), c2.bias, x, nxt)
        return x


class F0Predictor(nn.Module):
    def __init__(self, n_mels: int, ch: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [weight_norm(nn.Conv1d(n_mels if i == 0 else ch, ch, 3, padding=1)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(ch, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T] -> f0 [B, T] in Hz (non-negative)."""
        x = mel
        for m in self.condnet:
            x = conv(m, x) if isinstance(m, nn.Conv1d) else m(x)
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


class _Source(nn.Module):
    def __init__(self, n_harm: int) -> None:
        super().__init__()
        self.l_linear = nn.Linear(n_harm + 1, 1)


class HiFTGenerator(nn.Module):
    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c0, n_fft = cfg.base_channels, cfg.istft_n_fft
        self.f0_predictor = F0Predictor(cfg.mel.n_mels, cfg.f0_channels)
        self.m_source = _Source(cfg.nb_harmonics)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.mel.n_mels, c0, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(c0 // 2 ** i, c0 // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)))
        down_rates = [1] + list(cfg.upsample_rates[::-1][:-1])
        cum = [math.prod(down_rates[: i + 1]) for i in range(len(down_rates))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(cum, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilations,
                                          strict=True)):
            ch = c0 // 2 ** (i + 1)
            self.source_downs.append(nn.Conv1d(n_fft + 2, ch, 1) if u == 1 else
                                     nn.Conv1d(n_fft + 2, ch, u * 2, u, padding=u // 2))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(c0 // 2 ** (i + 1), k, d) for i in range(len(self.ups))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilations, strict=True))
        self.conv_post = weight_norm(nn.Conv1d(c0 // 2 ** len(self.ups), n_fft + 2, 7, padding=3))
        self.register_buffer("stft_window", torch.hann_window(n_fft), persistent=False)
        self._branch_streams = SideStreams()  # CUDA: made at first use (`_streams`)

    def fold_weight_norm(self) -> None:
        for m in self.modules():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)

    @property
    def n_harmonics(self) -> int:
        return self.cfg.nb_harmonics + 1

    def _source(self, f0: torch.Tensor, phase0: torch.Tensor, noise: torch.Tensor, keep_at: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 [B, T] Hz per frame; phase0 [B, H] cycles; noise [B, H, T * hop] standard normal -> source [B, T * hop]
        and the phase (cycles) to start the window `keep_at` samples later from.

        The harmonic phase follows the codec's 24 kHz SineGen2: the per-sample increment is summed at frame rate
        (each frame's increment x hop, the frame's phase reached at its centre) and linearly interpolated between
        frame centres to the sample rate (clamped to the first and last frame's phase at the edges)."""
        cfg = self.cfg
        hop, T = cfg.mel.hop, f0.shape[1]
        harm = torch.arange(1, self.n_harmonics + 1, device=f0.device, dtype=f0.dtype)[None, :, None]
        inc = torch.remainder(f0[:, None] * harm / cfg.mel.sample_rate, 1.0)  # cycles per sample [B, H, T]
        frame_cyc = torch.cumsum(inc * hop, dim=-1) + phase0[:, :, None]  # at frame centres
        pos = ((torch.arange(T * hop, device=f0.device, dtype=torch.float32) + 0.5) / hop - 0.5).clamp_(min=0)
        i0 = pos.long()
        i1 = (i0 + 1).clamp_(max=T - 1)
        w = (pos - i0).to(f0.dtype)
        cyc = frame_cyc[:, :, i0] * (1 - w) + frame_cyc[:, :, i1] * w  # [B, H, S]
        sine = cfg.nsf_alpha * torch.sin(2 * math.pi * torch.remainder(cyc, 1.0))
        f0s = f0.repeat_interleave(hop, dim=1)[:, None]  # [B, 1, S]
        uv = (f0s > cfg.voiced_threshold).to(f0.dtype)
        amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        sine = sine * uv + amp * noise
        src = torch.tanh(self.m_source.l_linear(sine.transpose(1, 2))).squeeze(-1)  # [B, S]
        # A window starting keep_at samples (whole frames) later sees these frames' phases from its frame 0 on.
        nxt = torch.remainder(frame_cyc[:, :, keep_at // hop - 1], 1.0) if keep_at > 0 else phase0
        return src, nxt

    def _source_stages(self, mel: torch.Tensor, phase0: torch.Tensor, noise: torch.Tensor, keep_at: int
                       ) -> Iterator[torch.Tensor]:
        """The source branch (f0 -> harmonic source -> STFT): yields the carried phase, then each upsample stage's
        source input [B, ch_i, T_i] in stage order."""
        cfg = self.cfg
        n_fft, hop = cfg.istft_n_fft, cfg.istft_hop
        src, nxt = self._source(self.f0_predictor(mel), phase0, noise, keep_at)
        yield nxt
        spec = torch.stft(src, n_fft, hop, n_fft, window=self.stft_window, return_complex=True)
        s_stft = torch.cat([spec.real, spec.imag], dim=1)  # [B, n_fft + 2, S / hop + 1]
        for down, block in zip(self.source_downs, self.source_resblocks, strict=True):
            yield block(conv(down, s_stft))

    def _streams(self, device: torch.device) -> list[torch.cuda.Stream]:
        """The branches' streams: one for the source branch, one per resblock of a stage but the first. Private
        (engines.lm.step_graphs.private_stream): the source branch runs cuBLAS GEMMs inside the vocoder's graphs."""
        return self._branch_streams.get(device, len(self.cfg.resblock_kernel_sizes))

    def forward(self, mel: torch.Tensor, phase0: torch.Tensor, noise: torch.Tensor, keep_at: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T] -> wav [B, T * hop] and the carried phase at `keep_at` samples.

        On CUDA the source branch runs on a stream of its own beside conv_pre and the upsampling, and a stage's
        resblocks (independent chains over the same input) run side by side; the arithmetic is that of the serial
        order, so the output is the same."""
        cfg = self.cfg
        n_fft, hop = cfg.istft_n_fft, cfg.istft_hop
        body = self._branched if mel.is_cuda else self._serial
        with float32_matmuls(False):  # the f0 classifier and source merge: IEEE whatever another thread has set
            x, nxt = body(mel, phase0, noise, keep_at)
        x = conv(self.conv_post, F.leaky_relu(x))
        half = n_fft // 2 + 1
        mag = torch.exp(x[:, :half]).clamp(max=1e2)
        ph = torch.sin(x[:, half:])
        wav = istft(torch.complex(mag * torch.cos(ph), mag * torch.sin(ph)), n_fft, hop, self.stft_window)
        return wav.clamp(-cfg.audio_limit, cfg.audio_limit), nxt

    def _upsample(self, i: int, x: torch.Tensor) -> torch.Tensor:
        x = conv(self.ups[i], F.leaky_relu(x, self.cfg.lrelu_slope))
        return F.pad(x, (1, 0), mode="reflect") if i == len(self.ups) - 1 else x

    def _serial(self, mel: torch.Tensor, phase0: torch.Tensor, noise: torch.Tensor, keep_at: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's body up to conv_post, one op after another: the reference order. -> (x, carried phase)."""
        nk = len(self.cfg.resblock_kernel_sizes)
        sources = self._source_stages(mel, phase0, noise, keep_at)
        nxt = next(sources)
        x = conv(self.conv_pre, mel)
        for i in range(len(self.ups)):
            x = self._upsample(i, x) + next(sources)
            x = sum(self.resblocks[i * nk + j](x) for j in range(nk)) / nk
        return x, nxt

    def _branched(self, mel: torch.Tensor, phase0: torch.Tensor, noise: torch.Tensor, keep_at: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's body up to conv_post with its independent chains on streams of their own. Tensors cross streams
        only where an event orders them: every branch waits for the main stream's state when it starts, and the main
        stream waits for a branch's event before it reads that branch's output (which the branch touches no more)."""
        nk = len(self.cfg.resblock_kernel_sizes)
        main = torch.cuda.current_stream()
        streams = self._streams(mel.device)
        src_stream, block_streams = streams[0], streams[1:]
        src_stream.wait_stream(main)
        with torch.cuda.stream(src_stream):
            sources = self._source_stages(mel, phase0, noise, keep_at)
            nxt = next(sources)
            staged = []  # (source input of stage i, the event after it)
            for src in sources:
                done = torch.cuda.Event()
                done.record(src_stream)
                staged.append((src, done))
        x = conv(self.conv_pre, mel)
        for i in range(len(self.ups)):
            x = self._upsample(i, x)
            src, done = staged[i]
            main.wait_event(done)
            x = x + src
            blocks = self.resblocks[i * nk:(i + 1) * nk]
            x = sum(side_by_side(block_streams, *(lambda b=b, x=x: b(x) for b in blocks))) / nk
        main.wait_stream(src_stream)  # the phase, and the source branch's last work
        return x, nxt
