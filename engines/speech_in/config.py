"""Shape of the causal Whisper-VQ speech encoder, read from / written to the codec's real config files.

The codec directory holds a Hugging Face style `config.json` (flat WhisperVQ keys such as `d_model`,
`quantize_position`, `pooling_kernel_size`) and a `preprocessor_config.json` (Whisper feature extractor:
`feature_size`, `sampling_rate`, `n_fft`, `hop_length`). We read both and map them onto one frozen dataclass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from engines.config import ConfigError, parse_dtype


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(frozen=True)
class EncoderConfig:
    """Causal Whisper-VQ encoder of the published codec."""

    num_mel_bins: int = 128
    d_model: int = 1280
    num_heads: int = 20
    ffn_dim: int = 5120
    # Layers actually run: the encoder is truncated at the quantizer (`quantize_position`).
    num_layers: int = 16
    # Layers of the Whisper trunk the checkpoint was cut from (`encoder_layers`): tensors of layers
    # num_layers..total_layers-1 may sit in the checkpoint and are ignored by name.
    total_layers: int = 32
    max_source_positions: int = 1500  # 50 Hz frames per segment (30 s); the model restarts after each segment
    pooling_kernel_size: int = 4  # 50 Hz -> 12.5 Hz
    codebook_size: int = 16384
    layer_norm_eps: float = 1e-5
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    # Whisper's log-mel dynamic range: values below (peak - 8) in log10 units are raised to it.
    log_mel_range: float = 8.0
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for f in ("num_mel_bins", "d_model", "num_heads", "ffn_dim", "num_layers", "total_layers",
                  "max_source_positions", "pooling_kernel_size", "codebook_size", "sampling_rate", "n_fft",
                  "hop_length"):
            v = getattr(self, f)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                     f"EncoderConfig.{f} must be a positive int, got {v!r}")
        _require(self.d_model % self.num_heads == 0,
                 f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})")
        _require(self.total_layers >= self.num_layers,
                 f"total_layers ({self.total_layers}) must be >= num_layers ({self.num_layers})")
        _require(self.max_source_positions % self.pooling_kernel_size == 0,
                 f"max_source_positions ({self.max_source_positions}) must be a multiple of "
                 f"pooling_kernel_size ({self.pooling_kernel_size}) so no code straddles a 30 s segment")
        _require(self.n_fft % 2 == 0 and self.n_fft >= self.hop_length,
                 f"n_fft ({self.n_fft}) must be even and >= hop_length ({self.hop_length})")
        _require(self.layer_norm_eps > 0, f"layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        _require(self.log_mel_range > 0, f"log_mel_range must be > 0, got {self.log_mel_range}")
        parse_dtype(self.torch_dtype)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def samples_per_code(self) -> int:
        """PCM samples per code: hop x conv2 stride 2 x pooling (1280 = 80 ms at 16 kHz)."""
        return self.hop_length * 2 * self.pooling_kernel_size

    @property
    def codes_per_segment(self) -> int:
        return self.max_source_positions // self.pooling_kernel_size

    @property
    def mel_per_segment(self) -> int:
        """Mel frames per 30 s segment (conv2 has stride 2)."""
        return 2 * self.max_source_positions

    @property
    def mel_per_code(self) -> int:
        return 2 * self.pooling_kernel_size

    @property
    def code_lag_samples(self) -> int:
        """How far into its 80 ms a code is determined: once its last mel frame is complete, whose window ends half
        a window past that frame's centre (1160 samples)."""
        return self.hop_length * (self.mel_per_code - 2) + self.n_fft // 2

    # ---- the codec's real config files -------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> EncoderConfig:
        """Read `config.json` (+ `preprocessor_config.json` when present) of a codec directory."""
        path = Path(path)
        raw = _read_json(path / "config.json")
        pre = _read_json(path / "preprocessor_config.json") if (path / "preprocessor_config.json").exists() else {}
        missing = sorted(k for k in ("d_model", "encoder_attention_heads", "encoder_ffn_dim", "num_mel_bins",
                                     "quantize_position", "quantize_vocab_size", "pooling_kernel_size")
                         if k not in raw)
        if missing:
            raise ConfigError(f"{path / 'config.json'}: missing encoder keys {missing}")
        # Only the causal, avg-pooled, pool-then-quantize variant streams; refuse the others by name.
        if not raw.get("encoder_causal_convolution", False):
            raise ConfigError(f"{path}: encoder_causal_convolution must be true (streaming needs causal convs)")
        if not (raw.get("encoder_causal_attention", False) or raw.get("quantize_causal_encoder", False)):
            raise ConfigError(f"{path}: the encoder attention must be causal (encoder_causal_attention)")
        if raw.get("pooling_type", "avg") != "avg":
            raise ConfigError(f"{path}: pooling_type {raw.get('pooling_type')!r} unsupported (need 'avg')")
        if raw.get("pooling_position", raw["quantize_position"]) != raw["quantize_position"]:
            raise ConfigError(f"{path}: pooling_position {raw.get('pooling_position')} != quantize_position "
                              f"{raw['quantize_position']} (pooling must sit right before the quantizer)")
        if pre and pre.get("feature_size", raw["num_mel_bins"]) != raw["num_mel_bins"]:
            raise ConfigError(f"{path}: preprocessor feature_size {pre.get('feature_size')} != num_mel_bins "
                              f"{raw['num_mel_bins']}")
        return cls(
            num_mel_bins=raw["num_mel_bins"], d_model=raw["d_model"], num_heads=raw["encoder_attention_heads"],
            ffn_dim=raw["encoder_ffn_dim"], num_layers=raw["quantize_position"],
            total_layers=raw.get("encoder_layers", raw["quantize_position"]),
            max_source_positions=raw.get("max_source_positions", 1500),
            pooling_kernel_size=raw["pooling_kernel_size"], codebook_size=raw["quantize_vocab_size"],
            sampling_rate=pre.get("sampling_rate", 16000), n_fft=pre.get("n_fft", 400),
            hop_length=pre.get("hop_length", 160), torch_dtype=raw.get("torch_dtype", "float32"),
        )

    def to_config_json(self) -> dict:
        """The encoder's keys of the codec `config.json` (WhisperVQ names)."""
        return {
            "architectures": ["WhisperVQEncoder"], "model_type": "whisper",
            "num_mel_bins": self.num_mel_bins, "d_model": self.d_model,
            "encoder_attention_heads": self.num_heads, "encoder_ffn_dim": self.ffn_dim,
            "encoder_layers": self.total_layers, "quantize_position": self.num_layers,
            "pooling_position": self.num_layers, "pooling_type": "avg",
            "pooling_kernel_size": self.pooling_kernel_size, "quantize_vocab_size": self.codebook_size,
            "quantize_encoder_only": True, "quantize_causal_encoder": True,
            "encoder_causal_attention": True, "encoder_causal_convolution": True,
            "max_source_positions": self.max_source_positions, "torch_dtype": self.torch_dtype,
        }

    def to_preprocessor_json(self) -> dict:
        return {
            "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": self.num_mel_bins,
            "sampling_rate": self.sampling_rate, "n_fft": self.n_fft, "hop_length": self.hop_length,
            "chunk_length": 30, "n_samples": 30 * self.sampling_rate, "padding_value": 0.0,
        }


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no {path.name} at {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


ENCODER_CONFIG_FIELDS = tuple(f.name for f in fields(EncoderConfig))
