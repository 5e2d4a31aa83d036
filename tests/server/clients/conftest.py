"""One real server (the real engine process, tiny random model) for the tests that drive real client libraries."""

from __future__ import annotations

import numpy as np
import pytest

from server.audio.pcm import read_wav
from tests.fakes.harness import RunningServer, tiny_settings
from tests.paths import DATA

KEY = "client-key"
# Answers of ~3 s of generation on a CPU: long enough to talk over, short enough for the suite. The clients send
# max_output_tokens "inf" (or nothing): this, the server's own answer length, ends them, and they complete.
ANSWER_ROWS = 40


@pytest.fixture(scope="package")
def srv():
    with RunningServer(tiny_settings(api_keys=[KEY], max_answer_rows=ANSWER_ROWS, drain_timeout_s=1.0)) as s:
        yield s


@pytest.fixture(scope="package")
def speech24k() -> np.ndarray:
    x, _ = read_wav(DATA / "speech_en_16k.wav", target_rate=24000)
    return x


def utterance(speech24k: np.ndarray, silence_s: float = 1.0) -> np.ndarray:
    """A spoken turn as a microphone sends it: a little silence, the speech, then silence that ends the turn."""
    return np.concatenate([np.zeros(4800, np.float32), speech24k, np.zeros(int(silence_s * 24000), np.float32)])
