"""The tiny random speech encoder the CPU tests of this directory share."""

from __future__ import annotations

import pytest

from engines.speech_in import SpeechEncoder


@pytest.fixture(scope="module")
def enc() -> SpeechEncoder:
    return SpeechEncoder.load("tiny-random", device="cpu")
