"""Speech encoder loading and front end: bfloat16 timing, the Slaney mel filterbank, checkpoint writing and key
checks, refused non-streaming configs, a missing checkpoint, and the encode CLI."""

from __future__ import annotations

import argparse
import json
import wave

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.config import ConfigError
from engines.speech_in import (
    ENCODER_PRESETS,
    EncoderCheckpointError,
    EncoderConfig,
    SpeechEncoder,
    write_random_encoder,
)
from engines.speech_in.log_mel import mel_filterbank
from tests.engines.speech_in.encoder_helpers import (
    SR,
    speech_like,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bfloat16_runs_and_keeps_timing():
    enc16 = SpeechEncoder.load("tiny-random", device="cpu", dtype="bfloat16")
    codes = enc16.encode(speech_like(1.0))
    assert len(codes) == 13 and all(0 <= c < 16384 for c in codes)


def test_mel_filterbank_is_slaney():
    fb = mel_filterbank(16000, 400, 128)
    assert fb.shape == (128, 201) and (fb >= 0).all()
    peaks = fb.argmax(axis=1)
    assert (np.diff(peaks) >= 0).all() and peaks[-1] > 190
    # Slaney normalisation: every triangle has unit area in Hz (check where filters span many FFT bins).
    area = fb.sum(axis=1) * (8000 / 200)
    # FFT-bin sampling of a triangle spanning ~5 bins moves its sum by up to ~10%.
    np.testing.assert_allclose(area[80:], 1.0, rtol=0.1)
    assert abs(area[80:].mean() - 1.0) < 0.01


def test_mel_frontend_puts_a_tone_in_its_band(enc):
    t = np.arange(SR) / SR
    tone = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    fe = enc.frontend
    mp = fe.plan([fe.new_state()], [tone], np.asarray([1000]))
    n = int(mp.counts[0])
    assert n == 100 - 1 and not mp.more  # frame t needs samples up to 160 t + 200
    peaks = torch.full((2,), float("-inf"))  # row 0 the stream's, row 1 the padding grid row's
    grid = torch.arange(n)  # one grid row of n cells
    frames = fe.log_mel(torch.from_numpy(mp.samples), torch.from_numpy(mp.starts[0] + 160 * np.arange(n)), grid,
                        torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([n - 1, n]), peaks, 2, n)
    assert frames.shape == (n, 128) and bool(torch.isfinite(peaks[0]))  # the stream's running peak written
    fb = mel_filterbank(16000, 400, 128)
    assert int(frames[50].argmax()) == int(fb[:, 25].argmax())  # FFT bin 25 = 1000 Hz


# ---- checkpoint layout and loader --------------------------------------------------------------------


def test_written_checkpoint_loads_and_matches_preset(enc, tmp_path):
    cfg = ENCODER_PRESETS["tiny-random"]
    (tmp_path / "config.json").write_text(json.dumps({"decoder_section": {"kept": True}}))
    write_random_encoder(tmp_path, cfg, seed=0)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["decoder_section"] == {"kept": True} and raw["quantize_position"] == cfg.num_layers
    assert EncoderConfig.from_dir(tmp_path) == cfg
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "encoder.layers.0.self_attn.k_proj.weight" in keys and "encoder.codebook.weight" in keys
    assert "encoder.layers.0.self_attn.k_proj.bias" not in keys
    loaded = SpeechEncoder.load(tmp_path)
    pcm = speech_like(1.0)
    assert loaded.encode(pcm) == enc.encode(pcm)


def test_loader_lists_every_bad_key(tmp_path):
    cfg = ENCODER_PRESETS["tiny-random"]
    write_random_encoder(tmp_path, cfg)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["encoder.layers.1.fc2.bias"]
    state["encoder.layers.0.fc1.weight"] = torch.zeros(3, 3)
    state["encoder.mystery.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(EncoderCheckpointError) as e:
        SpeechEncoder.load(tmp_path)
    msg = str(e.value)
    assert "missing 1: ['encoder.layers.1.fc2.bias']" in msg
    assert "unexpected 1: ['encoder.mystery.weight']" in msg
    assert "encoder.layers.0.fc1.weight: (3, 3) != expected (128, 64)" in msg


def test_loader_skips_known_unused_and_foreign_tensors(enc, tmp_path):
    cfg = ENCODER_PRESETS["tiny-random"]
    write_random_encoder(tmp_path, cfg)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["encoder.ema_count"] = torch.ones(16384)
    state["encoder.layers.2.fc1.weight"] = torch.zeros(128, 64)  # a layer past the quantizer
    state["decoder.something"] = torch.zeros(2)  # another codec part
    save_file(state, str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["encoder_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    pcm = speech_like(0.6)
    assert SpeechEncoder.load(tmp_path).encode(pcm) == enc.encode(pcm)


@pytest.mark.parametrize("change, msg", [
    ({"encoder_causal_convolution": False}, "causal convs"),
    ({"encoder_causal_attention": False, "quantize_causal_encoder": False}, "causal"),
    ({"pooling_type": "max"}, "pooling_type"),
    ({"pooling_position": 1}, "pooling_position"),
    ({"encoder_attention_heads": 5}, "multiple of num_heads"),
])
def test_config_refuses_non_streaming_variants(tmp_path, change, msg):
    write_random_encoder(tmp_path, ENCODER_PRESETS["tiny-random"])
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=msg):
        SpeechEncoder.load(tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        SpeechEncoder.load(tmp_path)


# ---- CLI ---------------------------------------------------------------------------------------------


def test_cli_encode_stereo_48k(enc, tmp_path, capsys):
    import soxr

    from moss_speech.commands import codec_encode as cmd

    t = np.arange(48000) / 48000
    left = 0.4 * np.sin(2 * np.pi * 300 * t)
    right = 0.2 * np.sin(2 * np.pi * 700 * t)
    frames = np.round(np.stack([left, right], axis=1) * 32767).astype("<i2")
    path = tmp_path / "in.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(48000)
        w.writeframes(frames.tobytes())
    mono = (frames.astype(np.float32) / 32768.0).mean(axis=1)
    expect = enc.encode(soxr.resample(mono, 48000, 16000, quality="HQ").astype(np.float32))
    for stream in (False, True):
        parser = argparse.ArgumentParser()
        cmd.add_arguments(parser)
        argv = ["--audio", str(path)] + (["--stream"] if stream else [])
        assert cmd.run(parser.parse_args(argv)) == 0
        out = capsys.readouterr().out.split()
        assert [int(c) for c in out] == expect
