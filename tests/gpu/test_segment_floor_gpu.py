"""A committed turn re-encoded with the whole-segment log-mel floor (engines/speech_in/segment_floor.py) on a CUDA
device: the codes of the dense whole-segment features, on an encoder with step graphs captured too, and across a 30 s
segment. Its cost at full size:
`python3 -m engines.profiling.refloor_cost --preset full-random --device cuda --graphs`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.audio.wav import read_wav
from engines.profiling.refloor_cost import turn
from engines.speech_in import SpeechEncoder
from tests.engines.speech_in.encoder_helpers import whole_segment_codes
from tests.paths import DATA

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def recording(seconds: float) -> np.ndarray:
    return turn(read_wav(DATA / "speech_en_16k.wav")[0], seconds)  # its first ~0.4 s are quiet


def committed(enc: SpeechEncoder, pcm: np.ndarray) -> list[int]:
    codes = enc.encode(pcm)
    r = enc.refloor(pcm, final=True)
    assert r is not None
    return codes[: r.first] + r.codes


@pytest.mark.parametrize("seconds", [2.5, 31.0])
def test_the_committed_codes_are_the_whole_segment_features_codes(seconds):
    enc = SpeechEncoder.load("tiny-random", device="cuda")
    pcm = recording(seconds)
    codes = committed(enc, pcm)
    if seconds < 30:
        assert codes == whole_segment_codes(enc, pcm)  # (the tool's dense features: one segment's framing)
    g = SpeechEncoder.load("tiny-random", device="cuda")
    g.reserve(4)
    g.capture_graphs(4)
    assert committed(g, pcm) == codes
