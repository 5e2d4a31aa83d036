"""An answer played at another speed: as long as 1/speed of it, at the same pitch, the same whichever way it is cut
into chunks; the GA range only."""

from __future__ import annotations

import numpy as np
import pytest

from server.audio.stretch import Stretch

RATE = 24000


def _tone(seconds: float, hz: float = 220.0) -> bytes:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2").tobytes()


def _samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, "<i2").astype(np.float64)


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 1.5])
def test_an_answer_lasts_one_over_speed_as_long_at_the_same_pitch(speed):
    s = Stretch(speed)
    out = _samples(s.process(_tone(2.0)) + s.flush())
    assert out.size == pytest.approx(2.0 * RATE / speed, rel=0.01)
    spectrum = np.abs(np.fft.rfft(out))
    assert np.argmax(spectrum) * RATE / out.size == pytest.approx(220.0, abs=1.0)


@pytest.mark.parametrize("speed", [0.4, 1.2])
def test_chunk_by_chunk_equals_the_whole_answer(speed):
    pcm = _tone(2.0, 180.0)
    whole = Stretch(speed)
    expected = whole.process(pcm) + whole.flush()
    for cut in (19200, 9600 * 2 + 14, 962):  # 0.4-s chunks, uneven ones, a byte count of whole samples
        s = Stretch(speed)
        got = b"".join(s.process(pcm[i:i + cut]) for i in range(0, len(pcm), cut)) + s.flush()
        assert got == expected
        assert s.flush() == b""  # its tail once


def test_the_first_chunk_comes_out_without_waiting_for_the_next():
    """Fed as 20-ms frames, the filter holds back only its window: most of a first 0.4-s chunk comes out at once."""
    s = Stretch(0.8)
    stretched = 0.4 * RATE / 0.8  # what the chunk becomes
    assert len(s.process(_tone(0.4))) // 2 > 0.8 * stretched


@pytest.mark.parametrize("speed", [0.2, 1.6, 0.0])
def test_speeds_outside_the_apis_range_are_refused(speed):
    with pytest.raises(ValueError, match="speed must be in"):
        Stretch(speed)
