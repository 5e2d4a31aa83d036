"""Random codec directories in the real file layout, for tests and benchmarks without the real codec.

Layout of a codec directory (decoder half; the encoder's `model.safetensors` is written by
engines/speech_in/weights.py):
  flow/flow.pt                  token -> mel flow state dict (real keys)
  flow/flow-chunk-5.pt          the chunk-streaming flow: the same keys (here the same tensors)
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

from engines.speech_in.presets import encoder_preset
from engines.speech_in.weights import write_random_encoder
from engines.speech_out.config import CodecDecoderConfig
from engines.speech_out.decoder import build_modules
from engines.speech_out.presets import preset_config


def write_random_decoder(path: str | Path, preset: str = "tiny-random", seed: int = 0) -> Path:
    """Write random flow.pt / flow-chunk-5.pt / hift.pt / BigVGAN files for `preset` under `path` (the codec
    directory)."""
    cfg = preset_config(preset)
    path = Path(path)
    (path / "flow").mkdir(parents=True, exist_ok=True)
    (path / "bigvgan").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    flow, hift, bigvgan = build_modules(cfg, with_bigvgan=True)
    torch.save(flow.state_dict(), path / "flow" / "flow.pt")
    torch.save(flow.state_dict(), path / "flow" / "flow-chunk-5.pt")
    torch.save(hift.generator.state_dict(), path / "flow" / "hift.pt")
    torch.save({"generator": bigvgan.generator.state_dict()}, path / "bigvgan" / "bigvgan_generator.pt")
    (path / "bigvgan" / "config.json").write_text(json.dumps(cfg.bigvgan.h_params(), indent=1))
    if cfg != CodecDecoderConfig():
        (path / "flow" / "decoder.json").write_text(json.dumps(cfg.to_json_dict(), indent=1))
    return path


def write_random_codec(path: str | Path, preset: str = "tiny-random", seed: int = 0) -> Path:
    """A whole random codec directory: the encoder's files (engines/speech_in) and the decoder's."""
    write_random_encoder(path, encoder_preset(preset), seed=seed)
    return write_random_decoder(path, preset, seed=seed)
