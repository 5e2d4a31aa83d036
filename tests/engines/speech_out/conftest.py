"""The tiny random codec decoders (HiFT and BigVGAN vocoders, and one with the windowed flow) the CPU tests of this
directory share."""

from __future__ import annotations

import pytest

from engines.speech_out import CodecDecoder


@pytest.fixture(scope="module")
def hift_dec() -> CodecDecoder:
    return CodecDecoder.load("tiny-random", vocoder="hift")


@pytest.fixture(scope="module")
def bigvgan_dec() -> CodecDecoder:
    return CodecDecoder.load("tiny-random", vocoder="bigvgan")


@pytest.fixture(scope="module")
def window_dec() -> CodecDecoder:
    """The opt-in windowed flow (the prompt and the last few chunks), whose internals several tests check."""
    return CodecDecoder.load("tiny-random", vocoder="hift", context="window")
