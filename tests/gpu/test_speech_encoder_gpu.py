"""The speech encoder's streaming and batching tests (tests/test_codec_encoder.py) on a CUDA device: the GPU path
of a step (one pinned upload of every index, gathered rows, views kept per stream) against its own whole-utterance
and one-stream results."""

from __future__ import annotations

import pytest
import torch

from engines.codec.encoder import SpeechEncoder
from tests.test_codec_encoder import (  # noqa: F401  (collected here, with this module's CUDA `enc`)
    test_batched_step_equals_each_alone,
    test_finalize_with_the_last_samples_equals_push_then_finalize,
    test_streaming_equals_whole,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def enc() -> SpeechEncoder:
    return SpeechEncoder.load("tiny-random", device="cuda")


def test_encoder_worker_on_its_thread_equals_one_stream_alone(enc):
    """The service's encoder worker on the GPU, on its thread and inline: the step's host sync goes through an
    event there."""
    from tests.test_encoder_worker import test_codes_equal_one_stream_alone_and_the_commit_comes_last as same_codes

    for threaded in (False, True):
        same_codes(enc, threaded)
