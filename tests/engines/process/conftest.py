"""The tiny speech encoder the encoder worker's and the service's re-encode tests share (module scope: its KV slots
must be free again after each test, which the tests check)."""

from __future__ import annotations

import pytest

from engines.speech_in import SpeechEncoder


@pytest.fixture(scope="module")
def enc() -> SpeechEncoder:
    return SpeechEncoder.load("tiny-random")
