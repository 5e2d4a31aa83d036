"""Frozen shapes of the decoder halves of the codec (flow and vocoders) and the streaming schedule.

Defaults are the real MOSS-Speech-Codec shapes (CosyVoice2 lineage).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engines.config import ConfigError
from engines.speech_out.mel_spec import CODEC_MEL, MelSpec


def _positive(obj: object, names: tuple[str, ...]) -> None:
    for f in names:
        v = getattr(obj, f)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{type(obj).__name__}.{f} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class FlowConfig:
    vocab_size: int = 20480  # embedding rows; codes are 0..16383
    input_size: int = 512  # token embedding width
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192  # CAM++ x-vector
    pre_lookahead: int = 3  # codes of right context per chunk
    token_mel_ratio: int = 4  # mel frames per code (50 Hz mel / 12.5 Hz codes)
    # Upsampling conformer encoder.
    d_model: int = 512
    heads: int = 8
    ffn: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    # CFM estimator (causal U-Net-like 1-D decoder).
    est_in_channels: int = 320  # x, mu, spk, cond: 4 x 80
    est_channels: int = 256
    est_heads: int = 8
    est_head_dim: int = 64
    est_n_blocks: int = 4  # transformer blocks per U-Net block
    est_mid_blocks: int = 12
    n_timesteps: int = 10  # Euler steps
    cfg_rate: float = 0.7
    sigma_min: float = 1e-6
    mel: MelSpec = CODEC_MEL

    def __post_init__(self) -> None:
        _positive(self, ("vocab_size", "input_size", "output_size", "spk_embed_dim", "pre_lookahead",
                         "token_mel_ratio", "d_model", "heads", "ffn", "num_blocks", "num_up_blocks",
                         "est_in_channels", "est_channels", "est_heads", "est_head_dim", "est_n_blocks",
                         "est_mid_blocks", "n_timesteps"))
        if self.d_model % self.heads:
            raise ConfigError(f"FlowConfig.d_model {self.d_model} not divisible by heads {self.heads}")
        if self.input_size != self.d_model:
            raise ConfigError("FlowConfig.input_size must equal d_model (the up-embedding reads encoder output)")
        if self.est_in_channels != 4 * self.output_size:
            raise ConfigError(f"FlowConfig.est_in_channels must be 4 x output_size, got {self.est_in_channels}")
        if self.output_size != self.mel.n_mels:
            raise ConfigError(f"FlowConfig.output_size {self.output_size} != mel.n_mels {self.mel.n_mels}")
        if self.vocab_size < 16384:
            raise ConfigError(f"FlowConfig.vocab_size {self.vocab_size} cannot hold codes 0..16383")


@dataclass(frozen=True)
class HiFTConfig:
    base_channels: int = 512
    nb_harmonics: int = 8
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    f0_channels: int = 512
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    mel: MelSpec = CODEC_MEL

    def __post_init__(self) -> None:
        _positive(self, ("base_channels", "nb_harmonics", "istft_n_fft", "istft_hop", "f0_channels"))
        up = 1
        for r in self.upsample_rates:
            up *= r
        if up * self.istft_hop != self.mel.hop:
            raise ConfigError(f"HiFT upsample {self.upsample_rates} x istft hop {self.istft_hop} = "
                              f"{up * self.istft_hop} must equal the mel hop {self.mel.hop}")
        if len(self.source_resblock_kernel_sizes) != len(self.upsample_rates):
            raise ConfigError("HiFT needs one source resblock per upsample stage")


@dataclass(frozen=True)
class BigVGANConfig:
    """h-params for `bigvgan.bigvgan.BigVGAN`, fixed to the codec mel (80 bins, 24 kHz, hop 480)."""

    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 10, 8, 6)
    # No public BigVGAN is trained on the codec mel, so "full-random" size is our choice: 512 channels
    # (BigVGAN-base class); the public 24 kHz v2 models use 1536.
    upsample_initial_channel: int = 512
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    activation: str = "snakebeta"
    mel: MelSpec = CODEC_MEL

    def __post_init__(self) -> None:
        up = 1
        for r in self.upsample_rates:
            up *= r
        if up != self.mel.hop:
            raise ConfigError(f"BigVGAN upsample_rates {self.upsample_rates} multiply to {up}, not hop {self.mel.hop}")

    def h_params(self) -> dict:
        m = self.mel
        return {
            "resblock": "1", "num_mels": m.n_mels, "sampling_rate": m.sample_rate, "hop_size": m.hop,
            "n_fft": m.n_fft, "win_size": m.win, "fmin": m.fmin, "fmax": m.fmax,
            "upsample_rates": list(self.upsample_rates), "upsample_kernel_sizes": list(self.upsample_kernel_sizes),
            "upsample_initial_channel": self.upsample_initial_channel,
            "resblock_kernel_sizes": list(self.resblock_kernel_sizes),
            "resblock_dilation_sizes": [list(d) for d in self.resblock_dilation_sizes],
            "activation": self.activation, "snake_logscale": True, "use_tanh_at_final": False,
            "use_bias_at_final": False,
        }


@dataclass(frozen=True)
class StreamConfig:
    chunk_codes: int = 5
    enc_left_chunks: int = 4  # encoder attention window behind the current chunk (plus the whole prompt)
    est_ctx_frames: int = 20  # mel frames of the previous chunk the estimator sees (fixed trajectories)
    voc_ctx_frames: int = 8  # mel frames of left context given to the vocoder
    crossfade_frames: int = 2  # held-back tail, crossfaded with the next window (2 frames = 40 ms)
    max_prompt_codes: int = 375  # 30 s of prompt

    def __post_init__(self) -> None:
        _positive(self, ("chunk_codes", "enc_left_chunks", "est_ctx_frames", "voc_ctx_frames", "crossfade_frames",
                         "max_prompt_codes"))
        if self.crossfade_frames >= self.voc_ctx_frames:
            raise ConfigError("StreamConfig.crossfade_frames must be < voc_ctx_frames")

    @property
    def steady_chunks(self) -> int:
        """Chunks after which a stream's every later chunk has the same shapes: the encoder's window of keys grows
        over the first enc_left_chunks (on a GPU a new key length is a graph capture). Benchmarks time after these."""
        return self.enc_left_chunks + 2


@dataclass(frozen=True)
class CodecDecoderConfig:
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    bigvgan: BigVGANConfig = field(default_factory=BigVGANConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)

    def to_json_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json_dict(cls, raw: dict, source: str = "config") -> CodecDecoderConfig:
        parts = {"flow": FlowConfig, "hift": HiFTConfig, "bigvgan": BigVGANConfig, "stream": StreamConfig}
        kw = {}
        for name, klass in parts.items():
            sub = dict(raw.get(name, {}))
            known = {f.name for f in fields(klass)}
            unknown = sorted(sub.keys() - known)
            if unknown:
                raise ConfigError(f"{source}: unknown keys {unknown} in {name}")
            if "mel" in sub:
                sub["mel"] = MelSpec(**sub["mel"])
            for k, v in list(sub.items()):
                if isinstance(v, list):
                    sub[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v)
            kw[name] = klass(**sub)
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> CodecDecoderConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from None
        return cls.from_json_dict(raw, str(path))
