"""The tiny random codec decoders (HiFT and BigVGAN vocoders) the CPU tests of this directory share."""

from __future__ import annotations

import pytest

from engines.speech_out import CodecDecoder


@pytest.fixture(scope="module")
def hift_dec() -> CodecDecoder:
    return CodecDecoder.load("tiny-random", vocoder="hift")


@pytest.fixture(scope="module")
def bigvgan_dec() -> CodecDecoder:
    return CodecDecoder.load("tiny-random", vocoder="bigvgan")
