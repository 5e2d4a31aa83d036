"""Rounds queued ahead (CodecDecoder.queue_jobs, engines/speech_out/queued.py): a round queued before the one before it
is collected gives the PCM that rounds run one after another give, each answer's held tail included, for both
decoder contexts (tiny codec on the CPU, where a queued round has already run: what this checks is the host's
bookkeeping at collect time, which carries an answer's crossfade from round to round; on a GPU, with rounds in
flight: tests/gpu/test_codec_decoder_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.speech_out import CodecDecoder
from tests.engines.speech_out.decoder_rounds import rounds_pcm

LENGTHS = (23, 17, 9)  # answers of unequal length: rounds of 3, then 2, then 1 answer


@pytest.mark.parametrize("context", ["full", "window"])
def test_rounds_queued_ahead_give_the_pcm_of_rounds_one_after_another(context):
    dec = CodecDecoder.load("tiny-random", device="cpu", vocoder="hift", context=context,
                            cache_gib=0.05 if context == "full" else None)
    ahead, serial = rounds_pcm(dec, LENGTHS, True), rounds_pcm(dec, LENGTHS, False)
    for a, s in zip(ahead, serial, strict=True):
        assert a.shape == s.shape and a.size > 0
        np.testing.assert_array_equal(a, s)
