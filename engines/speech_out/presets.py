"""Codec decoder presets: random weights at small or real shapes (random codec directories: random_codec.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.config import ConfigError
from engines.speech_out.config import BigVGANConfig, CodecDecoderConfig, FlowConfig, HiFTConfig, StreamConfig

DECODER_PRESETS: dict[str, CodecDecoderConfig] = {
    # Small widths, real vocab, real mel and real streaming schedule: the whole chain runs on a laptop CPU.
    "tiny-random": CodecDecoderConfig(
        flow=FlowConfig(input_size=32, d_model=32, heads=2, ffn=64, num_blocks=1, num_up_blocks=1, est_channels=32,
                        est_heads=2, est_head_dim=16, est_n_blocks=1, est_mid_blocks=1, n_timesteps=3),
        hift=HiFTConfig(base_channels=32, nb_harmonics=2, f0_channels=16, resblock_kernel_sizes=(3, 5),
                        resblock_dilations=((1, 3), (1, 3)), source_resblock_kernel_sizes=(3, 3, 3),
                        source_resblock_dilations=((1,), (1,), (1,))),
        bigvgan=BigVGANConfig(upsample_initial_channel=32, resblock_kernel_sizes=(3,),
                              resblock_dilation_sizes=((1, 3),)),
        stream=StreamConfig(),
    ),
    # Real shapes, random weights: for GPU benchmarks.
    "full-random": CodecDecoderConfig(),
}


def preset_config(name: str) -> CodecDecoderConfig:
    if name not in DECODER_PRESETS:
        raise ConfigError(f"unknown codec preset {name!r}; known: {sorted(DECODER_PRESETS)}")
    return DECODER_PRESETS[name]


def served_options(codec: str, on_gpu: bool, vocoder: str | None = None) -> dict[str, Any]:
    """`CodecDecoder.load`'s settings as the engine serves `codec`: on a GPU the flow's encoder and Euler solve are
    launch-bound, so they and the vocoder replay CUDA graphs, the estimator runs in bf16 and the encoder's float32
    matmuls on TF32. The vocoder, unless given: HiFT for a codec directory without `bigvgan/` (the published codec's
    layout), else BigVGAN."""
    if vocoder is None:
        vocoder = "hift" if Path(codec).is_dir() and not (Path(codec) / "bigvgan").is_dir() else "bigvgan"
    return {"vocoder": vocoder, "cuda_graphs": on_gpu, "encoder_graphs": on_gpu, "encoder_tf32": on_gpu,
            "estimator_dtype": "bfloat16" if on_gpu else "float32"}
