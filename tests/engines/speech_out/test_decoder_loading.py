"""Codec decoder loading: mel mismatches refused, written checkpoints load and match their preset, loader key checks,
old weight-norm names, voices from WAV, the decode CLI, the CAM++ x-vector through onnxruntime, a whole codec dir."""

from __future__ import annotations

import json
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engines.audio.wav import write_wav
from engines.speech_out import CodecDecoder, MelMismatchError, MelSpec, Voice
from engines.speech_out.checkpoint import CheckpointError
from engines.speech_out.config import HiFTConfig
from engines.speech_out.presets import DECODER_PRESETS
from engines.speech_out.random_codec import write_random_codec, write_random_decoder
from engines.speech_out.vocoder.vocoder import HiFTVocoder
from tests.engines.speech_out.campplus_stand_in import WEIGHT, write_campplus_stand_in
from tests.engines.speech_out.decoder_rounds import SPC, _codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_mel_mismatch_refused():
    cfg = DECODER_PRESETS["tiny-random"]
    other = MelSpec(sample_rate=22050, n_mels=80, hop=256, n_fft=1024, win=1024, fmin=0, fmax=8000)
    hcfg = HiFTConfig(base_channels=16, nb_harmonics=1, f0_channels=8, upsample_rates=(8, 8), istft_hop=4,
                      upsample_kernel_sizes=(16, 16), source_resblock_kernel_sizes=(3, 3),
                      source_resblock_dilations=((1,), (1,)), resblock_kernel_sizes=(3,), resblock_dilations=((1,),),
                      mel=other)
    ref = CodecDecoder.load("tiny-random", vocoder="hift")
    with pytest.raises(MelMismatchError) as e:
        CodecDecoder(cfg, ref.flow, HiFTVocoder(hcfg), "test", Voice.empty())
    assert "hop=256" in str(e.value) and "hop=480" in str(e.value)


def test_bigvgan_config_mel_mismatch_refused_at_load(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    h = json.loads((tmp_path / "bigvgan" / "config.json").read_text())
    h.update(num_mels=100, hop_size=256, n_fft=1024, win_size=1024, fmax=12000)
    (tmp_path / "bigvgan" / "config.json").write_text(json.dumps(h))
    with pytest.raises(MelMismatchError) as e:
        CodecDecoder.load(tmp_path, vocoder="bigvgan")
    assert "n_mels=100" in str(e.value) and "n_mels=80" in str(e.value)


@pytest.mark.parametrize("vocoder", ["hift", "bigvgan"])
def test_written_checkpoint_loads_and_matches_preset(tmp_path, vocoder):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    assert (tmp_path / "flow" / "flow.pt").is_file() and (tmp_path / "flow" / "hift.pt").is_file()
    loaded = CodecDecoder.load(tmp_path, vocoder=vocoder)
    preset = CodecDecoder.load("tiny-random", vocoder=vocoder, seed=0)
    codes = _codes(12, seed=9)
    # Same weights; the written codec has no built-in voice, so compare with the same explicit voice.
    v = Voice.random(seed=3, n_codes=4)
    np.testing.assert_allclose(loaded.decode(codes, voice=v, seed=1), preset.decode(codes, voice=v, seed=1),
                               atol=1e-6, rtol=0)


def test_loader_names_missing_and_unexpected_keys(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    f = tmp_path / "flow" / "flow-chunk-5.pt"  # the streaming decoder's weights
    sd = torch.load(f, weights_only=True)
    sd.pop("encoder.after_norm.weight")
    sd["encoder.bogus.weight"] = torch.zeros(1)
    sd["encoder_proj.weight"] = torch.zeros(3, 3)
    torch.save(sd, f)
    with pytest.raises(CheckpointError) as e:
        CodecDecoder.load(tmp_path, vocoder="hift")
    msg = str(e.value)
    assert "encoder.after_norm.weight" in msg and "encoder.bogus.weight" in msg and "encoder_proj.weight" in msg
    assert str(f) in msg


def test_hift_accepts_old_weight_norm_names(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    f = tmp_path / "flow" / "hift.pt"
    sd = torch.load(f, weights_only=True)
    old = {}
    for k, v in sd.items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1",
                                                                               "weight_v")
        old["generator." + k] = v
    torch.save(old, f)
    a = CodecDecoder.load(tmp_path, vocoder="hift").decode(_codes(8), voice=Voice.random(1, 2), seed=0)
    b = CodecDecoder.load("tiny-random", vocoder="hift").decode(_codes(8), voice=Voice.random(1, 2), seed=0)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_real_codec_without_bigvgan_says_use_hift(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    for p in (tmp_path / "bigvgan").iterdir():
        p.unlink()
    with pytest.raises(ValueError, match="hift"):
        CodecDecoder.load(tmp_path, vocoder="bigvgan")


def test_voice_from_wav_with_fake_encoder(tmp_path, hift_dec):
    # campplus.onnx is not written by the tests (no onnx builder dependency): the x-vector path is covered by
    # kaldi_fbank here and by campplus=None giving a zero x-vector.
    from engines.speech_out.voice import kaldi_fbank

    sr = 16000
    t = np.arange(int(0.9 * sr)) / sr
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    path = tmp_path / "v.wav"
    write_wav(path, pcm, sr)
    v = Voice.from_wav(path, encode=lambda x: list(range(len(x) // 1280)), campplus=None)
    assert v.codes.shape[0] == 11 and v.mel.shape == (80, 44) and torch.count_nonzero(v.xvector) == 0
    fb = kaldi_fbank(torch.from_numpy(pcm))
    assert fb.shape == (1 + (len(pcm) - 400) // 160, 80) and torch.isfinite(fb).all()
    # The 220 Hz tone's band is the loudest.
    assert int(fb.mean(0).argmax()) < 20
    out = hift_dec.decode(_codes(6), voice=v, seed=0)
    assert out.shape == (6 * SPC,)


def test_cli_decode_writes_exact_length_wav(tmp_path):
    from moss_speech.commands import codec_decode as decode

    codes_file = tmp_path / "codes.txt"
    codes_file.write_text("1, 2 3\n4,5 6 7 8 9 10 11")
    out = tmp_path / "o.wav"
    args = SimpleNamespace(codec="tiny-random", codes=str(codes_file), out=str(out), vocoder="hift", stream=True,
                           device="cpu", seed=0, voice=None)
    assert decode.run(args) == 0
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 11 * SPC)
    # A WAV voice prompt goes through the codec's encoder; the output length does not depend on it.
    args.voice, args.stream = str(out), False
    assert decode.run(args) == 0
    with wave.open(str(out)) as w:
        assert w.getnframes() == 11 * SPC
    np.save(tmp_path / "c.npy", np.array([3, 16384]))
    args.codes = str(tmp_path / "c.npy")
    assert decode.run(args) == 2


def test_campplus_xvector_through_onnxruntime(tmp_path):
    """A stand-in campplus.onnx (max over time of the fbank, then a fixed 80 x 192 matrix) checks the feature
    normalisation, the onnxruntime call and the output shape; the real CAM++ network is not available here."""
    from engines.speech_out.voice import campplus_xvector, kaldi_fbank

    path = write_campplus_stand_in(tmp_path / "campplus.onnx")
    wav = torch.from_numpy(np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 0.1)
    got = campplus_xvector(wav, path)
    fb = kaldi_fbank(wav)
    want = (fb - fb.mean(0, keepdim=True)).amax(0).numpy() @ WEIGHT
    assert got.shape == (192,)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-3)


def test_whole_random_codec_dir_serves_both_halves(tmp_path):
    from engines.speech_in import SpeechEncoder

    write_random_codec(tmp_path, "tiny-random", seed=0)
    codes = SpeechEncoder.load(tmp_path).encode(np.zeros(16000, dtype=np.float32))
    pcm = CodecDecoder.load(tmp_path, vocoder="hift").decode(codes)
    assert len(codes) > 0 and pcm.shape == (len(codes) * SPC,)
