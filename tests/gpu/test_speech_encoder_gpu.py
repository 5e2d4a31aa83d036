"""The speech encoder's streaming and batching checks (tests/engines/speech_in/encoder_helpers.py) on a CUDA device:
the GPU path of a step (one pinned upload of every index and the samples, gathered rows, state rows at each slot)
against its own whole-utterance and one-stream results."""

from __future__ import annotations

import pytest
import torch

from engines.cuda.streams import is_urgent
from engines.speech_in import SpeechEncoder
from tests.engines.process.encoder_worker_checks import (
    check_committed_codes_are_the_whole_segment_ones_and_the_commit_comes_last,
)
from tests.engines.speech_in.encoder_helpers import (
    BATCH_PCMS,
    BATCH_SIZES,
    FEATURE_ATOL,
    FINALIZE_SPLITS,
    STREAM_SIZE_IDS,
    STREAM_SIZES,
    batched_encode,
    check_batched_step_equals_each_alone,
    check_finalize_with_the_last_samples_equals_push_then_finalize,
    check_streaming_equals_whole,
    speech_like,
    stream_encode,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def enc() -> SpeechEncoder:
    return SpeechEncoder.load("tiny-random", device="cuda")


@pytest.mark.parametrize("sizes", STREAM_SIZES, ids=STREAM_SIZE_IDS)
def test_streaming_equals_whole(enc, sizes):
    check_streaming_equals_whole(enc, sizes)


@pytest.mark.parametrize("split", FINALIZE_SPLITS)
def test_finalize_with_the_last_samples_equals_push_then_finalize(enc, split):
    check_finalize_with_the_last_samples_equals_push_then_finalize(enc, split)


def test_batched_step_equals_each_alone(enc):
    check_batched_step_equals_each_alone(enc)


def test_encoder_worker_on_its_thread_equals_one_stream_alone(enc):
    """The service's encoder worker on the GPU, on its thread and inline: the step's host sync goes through an
    event there."""
    for threaded in (False, True):
        check_committed_codes_are_the_whole_segment_ones_and_the_commit_comes_last(enc, threaded)


def test_step_graphs_equal_eager_steps(enc):
    """Steps of up to 4 streams replayed as CUDA graphs (buckets of streams, frames and keys; padding in the spare KV
    slot) give the eager steps' codes and features: batched, streamed with pushes in and out of the buckets, and
    across a 30 s segment."""
    g = SpeechEncoder.load("tiny-random", device="cuda")
    g.reserve(4)
    assert g.capture_graphs(4) == 3 * 7 * 11  # streams 1, 2, 4; frames 1-64; keys 16-1500
    graphs = g.runner.graphs
    assert is_urgent(graphs.stream)  # a commit's call waits on them: captured (so replayed) urgent
    pcms = [speech_like(t, seed=seed) for t, seed in BATCH_PCMS]
    for (codes, feats), (codes1, feats1) in zip(batched_encode(g, pcms, BATCH_SIZES),
                                                batched_encode(enc, pcms, BATCH_SIZES), strict=True):
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)
    assert graphs.replays > 10
    for seconds, sizes in ((2.3, [20000, 320]), (2.3, [1, 5000, 17, 640, 0, 1279]), (31.0, [8000, 4321])):
        pcm = speech_like(seconds, seed=3)
        codes, feats = stream_encode(g, pcm, sizes)
        codes1, feats1 = stream_encode(enc, pcm, sizes)
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)
