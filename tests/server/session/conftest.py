from __future__ import annotations

import numpy as np
import pytest

from server.audio.pcm import read_wav
from tests.paths import DATA


@pytest.fixture(scope="module")
def speech24k() -> np.ndarray:
    """An English speech sample at 24 kHz."""
    x, rate = read_wav(DATA / "speech_en_16k.wav", target_rate=24000)
    assert rate == 24000
    return x
