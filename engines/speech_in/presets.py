"""Named encoder shapes: `tiny-random` for CPU tests, `full-random` for GPU benchmarks.

full-random follows the MOSS-Speech codec's encoder: Whisper-large-v3 widths (d_model 1280, 20 heads,
ffn 5120, 128 mel bins) but only the first 16 of the 32 Whisper layers, because the WhisperVQ config of
the GLM-4-Voice lineage the codec comes from sets `quantize_position: 16`, `pooling_position: 16`,
`quantize_encoder_only: true` (the trunk is cut at the quantizer). Seen in public configs of the codec's
streaming encoder and in a converter for fnlp/MOSS-Speech-Codec that keeps `quantize_position` layers;
the released config.json itself was not available to check.
"""

from __future__ import annotations

from engines.config import ConfigError
from engines.speech_in.config import EncoderConfig

ENCODER_PRESETS: dict[str, EncoderConfig] = {
    # Real frontend, real code count and timing; tiny trunk.
    "tiny-random": EncoderConfig(d_model=64, num_heads=4, ffn_dim=128, num_layers=2, total_layers=2),
    "full-random": EncoderConfig(),
}


def encoder_preset(name: str) -> EncoderConfig:
    if name not in ENCODER_PRESETS:
        raise ConfigError(f"unknown encoder preset {name!r}; known: {sorted(ENCODER_PRESETS)}")
    return ENCODER_PRESETS[name]
