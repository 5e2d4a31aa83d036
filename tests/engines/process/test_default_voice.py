"""The default voice: a session that sets no voice prompt speaks in the bundled recording's voice (its prompt codes,
mel and speaker vector), or in the one `--voice WAV` names; never in an empty prompt with a zero speaker vector."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.audio.wav import read_wav, write_wav
from engines.config import ConfigError
from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from engines.protocol import messages as m
from engines.speech_out import voice as voice_module
from engines.speech_out.mel_spec import CODEC_MEL, log_mel
from engines.speech_out.random_codec import write_random_codec
from engines.speech_out.voice import BUNDLED_VOICE_CODES, DEFAULT_VOICE_WAV, resample
from tests.engines.process import service_loop
from tests.engines.speech_out.campplus_stand_in import write_campplus_stand_in

BASE = ["--device", "cpu", "--model", "tiny-random", "--no-warm-up", "--vocoder", "hift"]


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
    """A random codec directory with a campplus.onnx in place (the x-vector itself is computed by a stand-in below,
    which depends on the recording more visibly)."""
    root = write_random_codec(tmp_path_factory.mktemp("codec"))
    write_campplus_stand_in(root / "flow" / "campplus.onnx")
    return root


def stand_in_xvector(wav16: torch.Tensor, onnx_path) -> torch.Tensor:
    """A speaker vector that depends on the recording (campplus.onnx is not built by the tests)."""
    return torch.linspace(-1.0, 1.0, 192) * float(wav16.abs().mean()) + 0.5


def test_a_session_without_a_voice_speaks_in_the_bundled_voice(codec_dir, monkeypatch) -> None:
    monkeypatch.setattr(voice_module, "campplus_xvector", stand_in_xvector)
    svc = build_service(ProcessConfig.parse([*BASE, "--codec", str(codec_dir)]))
    dec = svc.decoder
    v = dec.default_voice
    pcm, rate = read_wav(DEFAULT_VOICE_WAV)
    w = torch.from_numpy(pcm)
    mel = log_mel(resample(w, rate, CODEC_MEL.sample_rate)[None], CODEC_MEL)[0]
    codes = svc.encoder.encode(resample(w, rate, 16000).numpy())
    n = min(len(codes), mel.shape[1] // 4)
    assert n == BUNDLED_VOICE_CODES  # ~5.9 s of speech
    assert v.codes.tolist() == codes[:n]
    torch.testing.assert_close(v.mel, mel[:, :4 * n].float())
    torch.testing.assert_close(v.xvector, stand_in_xvector(resample(w, rate, 16000), None))
    assert torch.count_nonzero(v.xvector) == 192

    used = []
    get = dec.voices.get
    monkeypatch.setattr(dec.voices, "get", lambda voice: used.append(voice) or get(voice))
    svc.handle(b"c", m.OpenSession("s"))
    svc.handle(b"c", m.AddUserText("s", "i", "hello"))
    svc.handle(b"c", m.CreateResponse("s", "r", "audio", m.Sampling(greedy=True, max_new_tokens=6, min_new_tokens=6)))
    msgs = [x for _, x in service_loop.until_idle(svc)]
    assert [d.status for d in msgs if isinstance(d, m.ResponseDone)] == ["incomplete"]
    assert used == [v]
    pv = get(v)
    assert pv.mel.shape[1] == 4 * n and torch.count_nonzero(pv.spks) > 0 and torch.count_nonzero(pv.mel) > 0


def test_voice_option_chooses_another_and_bad_ones_are_refused_at_start(codec_dir, tmp_path) -> None:
    t = np.arange(16000 * 2) / 16000
    path = tmp_path / "mine.wav"
    write_wav(path, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 16000)
    svc = build_service(ProcessConfig.parse([*BASE, "--codec", "tiny-random", "--voice", str(path)]))
    v = svc.decoder.default_voice
    assert v.codes.numel() == 25 and v.mel.shape == (80, 100) and v.name.startswith("wav-")
    write_wav(path, np.zeros(400 * 100, np.float32), 400)
    with pytest.raises(ConfigError, match="--voice .*sample rate 400 Hz"):
        ProcessConfig.parse([*BASE, "--codec", "tiny-random", "--voice", str(path)])
    with pytest.raises(ConfigError, match="no such WAV file"):
        ProcessConfig.parse([*BASE, "--codec", "tiny-random", "--voice", str(tmp_path / "missing.wav")])
    with pytest.raises(ConfigError, match="needs a codec"):
        ProcessConfig.parse([*BASE, "--codec", "none", "--voice", str(DEFAULT_VOICE_WAV)])
