"""Resampling against analytic sines, streaming == whole, PCM/WAV helpers, bad audio errors."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from server.audio import AudioError, Resampler, float32_to_pcm16, pcm16_to_float32, read_wav, resample, to_16k

EDGE = 200  # output samples at each end where the filter sees the signal start/stop (not a steady sine)
SINE_ATOL = 1e-5  # measured ~2e-7 for soxr HQ on a 440 Hz sine


def sine(rate: int, seconds: float, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


@pytest.mark.parametrize("src, dst", [(48000, 16000), (24000, 16000), (44100, 16000), (24000, 48000),
                                      (8000, 16000)])
def test_resampled_sine_matches_analytic(src, dst):
    out = resample(sine(src, 1.0), src, dst)
    ref = sine(dst, 1.0)
    assert out.dtype == np.float32 and abs(out.size - ref.size) <= 1
    n = min(out.size, ref.size)
    np.testing.assert_allclose(out[EDGE:n - EDGE], ref[EDGE:n - EDGE], atol=SINE_ATOL, rtol=0)


def test_to_16k_removes_content_above_new_nyquist():
    x = sine(48000, 1.0, freq=12000.0)  # above 8 kHz: must not alias into the 16 kHz signal
    out = to_16k(x, 48000)
    assert np.abs(out[EDGE:-EDGE]).max() < 1e-3


@pytest.mark.parametrize("piece", [960, 37, 1234, 1], ids=["20ms@48k", "37", "1234", "1"])
def test_streaming_equals_whole(piece):
    rng = np.random.default_rng(0)
    x = (sine(48000, 0.5) + 0.1 * rng.standard_normal(24000)).astype(np.float32)
    whole = resample(x, 48000, 16000)
    r = Resampler(48000, 16000)
    out = np.concatenate([r.process(x[i:i + piece]) for i in range(0, x.size, piece)] + [r.flush()])
    assert out.size == whole.size
    np.testing.assert_allclose(out, whole, atol=1e-6, rtol=0)


def test_streaming_passthrough_and_upsampling_for_webrtc():
    x = sine(16000, 0.2)
    r = Resampler(16000, 16000)
    np.testing.assert_array_equal(np.concatenate([r.process(x[:100]), r.process(x[100:]), r.flush()]), x)
    y = sine(24000, 0.3)
    up = Resampler(24000, 48000)
    out = np.concatenate([up.process(y[i:i + 480]) for i in range(0, y.size, 480)] + [up.flush()])
    np.testing.assert_allclose(out, resample(y, 24000, 48000), atol=1e-6, rtol=0)


@pytest.mark.parametrize("rate, msg", [(0, "positive"), (-16000, "positive"), (16000.5, "positive integer"),
                                       ("16000", "positive integer"), (True, "positive integer"),
                                       (1000, "unsupported"), (400000, "unsupported")])
def test_bad_rate(rate, msg):
    with pytest.raises(AudioError, match=msg):
        to_16k(sine(16000, 0.1), rate)
    with pytest.raises(AudioError, match=msg):
        Resampler(rate, 16000)


@pytest.mark.parametrize("x, msg", [
    (np.zeros(0, np.float32), "empty"),
    (np.array([0.1, np.nan], np.float32), "NaN"),
    (np.array([np.inf, 0.0], np.float32), "infinite"),
    (np.zeros((2, 100), np.float32), "mono"),
    (np.zeros(100, np.int16), "floats"),
])
def test_bad_samples(x, msg):
    with pytest.raises(AudioError, match=msg):
        to_16k(x, 48000)


def test_too_long():
    with pytest.raises(AudioError, match="limit is 1 s"):
        to_16k(sine(48000, 1.5), 48000, max_seconds=1.0)
    assert to_16k(sine(48000, 0.9), 48000, max_seconds=1.0).size == 14400


def test_audio_error_is_value_error_and_flushed_stream_refuses():
    r = Resampler(48000, 16000)
    r.flush()
    with pytest.raises(ValueError, match="flushed"):
        r.process(np.zeros(10, np.float32))


def test_pcm16_roundtrip_and_errors():
    x = np.array([-1.0, -0.5, 0.0, 0.25, 0.999, 1.5], np.float32)  # 1.5: out of range
    b = float32_to_pcm16(x)
    assert len(b) == 12
    y = pcm16_to_float32(b)
    np.testing.assert_allclose(y[:-2], x[:-2], atol=0.5 / 32768 + 1e-9)  # in range: within half a step
    assert y[-1] == 32767 / 32768  # saturated, not wrapped
    with pytest.raises(AudioError, match="even number"):
        pcm16_to_float32(b[:-1])


@pytest.mark.parametrize("width", [1, 2, 3])
def test_read_wav_mono_mix_widths_and_resample(tmp_path, width):
    rate, n = 24000, 2400
    left, right = sine(rate, n / rate, amp=0.5), sine(rate, n / rate, freq=880.0, amp=0.25)
    scale = {1: 127, 2: 32767, 3: 8388607}[width]
    ints = np.round(np.stack([left, right], axis=1) * scale).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 2:
        raw = ints.astype("<i2").tobytes()
    else:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints.ravel())
    path = tmp_path / "x.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    x, r = read_wav(path)
    assert r == rate and x.shape == (n,)
    np.testing.assert_allclose(x, (left + right) / 2, atol=1.5 / scale)
    y, r16 = read_wav(path, target_rate=16000)
    assert r16 == 16000 and y.size == 1600


def test_read_wav_errors(tmp_path):
    with pytest.raises(AudioError, match="no such WAV"):
        read_wav(tmp_path / "missing.wav")
    (tmp_path / "junk.wav").write_bytes(b"not a wav file at all")
    with pytest.raises(AudioError, match="not a PCM WAV"):
        read_wav(tmp_path / "junk.wav")
