"""Codec decoder presets and the writer of random decoder checkpoints in the real file layout.

Layout of a codec directory (decoder half; the encoder's `model.safetensors` is written by
engines/speech_in/presets.py):
  flow/flow.pt                  token -> mel flow state dict (real keys)
  flow/hift.pt                  HiFT vocoder state dict (real keys)
  flow/campplus.onnx            CAM++ speaker model (not written here: random presets use a built-in voice)
  flow/decoder.json             shapes, only for non-default (random) configs; absent in the real codec
  bigvgan/bigvgan_generator.pt  {"generator": state dict}, BigVGAN's own format (not part of the public codec)
  bigvgan/config.json           BigVGAN h-params; its mel fields are checked against the flow's mel
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

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


def write_random_decoder(path: str | Path, preset: str = "tiny-random", seed: int = 0) -> Path:
    """Write random flow.pt / hift.pt / BigVGAN files for `preset` under `path` (the codec directory)."""
    from engines.speech_out.decoder import build_modules

    cfg = preset_config(preset)
    path = Path(path)
    (path / "flow").mkdir(parents=True, exist_ok=True)
    (path / "bigvgan").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    flow, hift, bigvgan = build_modules(cfg, with_bigvgan=True)
    torch.save(flow.state_dict(), path / "flow" / "flow.pt")
    torch.save(hift.generator.state_dict(), path / "flow" / "hift.pt")
    torch.save({"generator": bigvgan.generator.state_dict()}, path / "bigvgan" / "bigvgan_generator.pt")
    (path / "bigvgan" / "config.json").write_text(json.dumps(cfg.bigvgan.h_params(), indent=1))
    if cfg != CodecDecoderConfig():
        (path / "flow" / "decoder.json").write_text(json.dumps(cfg.to_json_dict(), indent=1))
    return path


def write_random_codec(path: str | Path, preset: str = "tiny-random", seed: int = 0) -> Path:
    """A whole random codec directory: the encoder's files (engines/speech_in) and the decoder's."""
    from engines.speech_in import encoder_preset
    from engines.speech_in.weights import write_random_encoder

    write_random_encoder(path, encoder_preset(preset), seed=seed)
    return write_random_decoder(path, preset, seed=seed)
