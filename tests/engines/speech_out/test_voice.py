"""Voice prompts from recordings: the reference's first aligned part, and the bounds a recording must keep."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.audio.voice_prompt import MAX_SECONDS, check_voice_prompt
from engines.audio.wav import AudioFormatError, write_wav
from engines.config import ConfigError
from engines.speech_out.mel_spec import CODEC_MEL, log_mel
from engines.speech_out.voice import Voice, aligned_prompt, resample


def test_aligned_prompt_keeps_the_first_codes_and_their_frames():
    """min(frames // 4, codes) codes from the start, with the 4 mel frames of each (a frame short: the last code
    goes; codes short: the last frames go), as the codec's reference frontend does."""
    mel = torch.arange(80 * 37, dtype=torch.float32).reshape(80, 37)
    codes, m = aligned_prompt(torch.arange(10), mel, 375)
    assert codes.tolist() == list(range(9)) and torch.equal(m, mel[:, :36])
    codes, m = aligned_prompt(torch.arange(5), mel, 375)
    assert codes.tolist() == list(range(5)) and torch.equal(m, mel[:, :20])
    codes, m = aligned_prompt(torch.arange(10), mel, 3)
    assert codes.tolist() == [0, 1, 2] and torch.equal(m, mel[:, :12])


def test_voice_from_wav_keeps_the_start_of_the_recording(tmp_path):
    sr = 16000
    t = np.arange(int(1.3 * sr)) / sr
    pcm = (0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t)).astype(np.float32)
    path = tmp_path / "v.wav"
    write_wav(path, pcm, sr)
    # An encoder that gives more codes than the mel has frames for: the codes at the start are kept.
    v = Voice.from_wav(path, encode=lambda x: list(range(100, 100 + len(x) // 1280 + 3)), campplus=None)
    wav = torch.from_numpy(np.round(pcm * 32768).clip(-32768, 32767) / 32768).float()
    mel = log_mel(resample(wav, sr, CODEC_MEL.sample_rate)[None], CODEC_MEL)[0]
    n = mel.shape[1] // 4
    assert v.codes.tolist() == list(range(100, 100 + n))
    torch.testing.assert_close(v.mel, mel[:, :4 * n].float())
    assert v.name == str(path)
    assert Voice.from_wav(path.read_bytes(), encode=lambda x: [1] * 40, campplus=None, name="x").name == "x"


@pytest.mark.parametrize(("rate", "seconds", "why"), [
    (400, 975.0, "sample rate"), (7_999, 1.0, "sample rate"), (192_001, 0.5, "sample rate"),
    (8_000, MAX_SECONDS + 0.5, "longer"), (24_000, 0.01, "shorter"), (16_000, 0.079, "shorter")])
def test_prompts_out_of_bounds_are_refused_from_the_header(tmp_path, rate, seconds, why):
    path = tmp_path / "v.wav"
    write_wav(path, np.zeros(int(rate * seconds), np.float32), rate)
    with pytest.raises(AudioFormatError, match=why):
        check_voice_prompt(path.read_bytes())
    with pytest.raises(ConfigError, match=why):
        Voice.from_wav(path, encode=lambda x: pytest.fail("encoded a refused prompt"), campplus=None)


def test_a_header_claiming_more_frames_than_the_file_holds_is_bounded_by_its_size(tmp_path):
    path = tmp_path / "v.wav"
    write_wav(path, np.zeros(16000, np.float32), 16000)
    data = bytearray(path.read_bytes())
    data[40:44] = (0x7FFFFFF0).to_bytes(4, "little")  # the data chunk's size: "18 hours"
    assert check_voice_prompt(bytes(data)) == pytest.approx(1.0, abs=1e-2)
    assert check_voice_prompt(path) == pytest.approx(1.0)
    with pytest.raises(AudioFormatError, match="not a PCM WAV"):
        check_voice_prompt(b"RIFF\x00\x00\x00\x00WAVEjunk")
