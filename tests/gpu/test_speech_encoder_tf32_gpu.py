"""The speech encoder on TF32 (`--encoder-tf32`, StreamingRunner.tf32) on a CUDA device: its streaming and batching
checks (tests/engines/speech_in/encoder_helpers.py) with a TF32 encoder, its CUDA graphs against its eager steps, and
its features and codes against the float32-accurate encoder's."""

from __future__ import annotations

import pytest
import torch

from engines.speech_in import SpeechEncoder
from tests.engines.speech_in.encoder_helpers import (
    BATCH_PCMS,
    BATCH_SIZES,
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

# Streamed and whole steps split a query's keys differently (encoder_attention.num_splits), so the attention's
# float32 sums differ in their last bits; on TF32 the next GEMM's inputs are cut to 10 mantissa bits, where such a
# difference now and then lands across a cut (float32 accuracy: within 1e-4). The codes must still be equal.
TF32_FEATURE_ATOL = 2e-3


@pytest.fixture(scope="module")
def enc() -> SpeechEncoder:
    e = SpeechEncoder.load("tiny-random", device="cuda", tf32=True)
    assert e.runner.tf32
    return e


@pytest.mark.parametrize("sizes", STREAM_SIZES, ids=STREAM_SIZE_IDS)
def test_streaming_equals_whole(enc, sizes):
    check_streaming_equals_whole(enc, sizes, atol=TF32_FEATURE_ATOL)


@pytest.mark.parametrize("split", FINALIZE_SPLITS)
def test_finalize_with_the_last_samples_equals_push_then_finalize(enc, split):
    check_finalize_with_the_last_samples_equals_push_then_finalize(enc, split)


def test_batched_step_equals_each_alone(enc):
    check_batched_step_equals_each_alone(enc, atol=TF32_FEATURE_ATOL)


def test_tf32_step_graphs_equal_its_eager_steps(enc):
    """Graphs captured under TF32 (the capture reads the setting) give the eager TF32 steps' codes and features."""
    g = SpeechEncoder.load("tiny-random", device="cuda", tf32=True)
    g.reserve(4)
    g.capture_graphs(4)
    pcms = [speech_like(t, seed=seed) for t, seed in BATCH_PCMS]
    for (codes, feats), (codes1, feats1) in zip(batched_encode(g, pcms, BATCH_SIZES),
                                                batched_encode(enc, pcms, BATCH_SIZES),
                                                strict=True):
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=TF32_FEATURE_ATOL, rtol=0)
    assert g.runner.graphs.replays > 10


@pytest.mark.parametrize("preset", ["tiny-random", "full-random"])
def test_tf32_features_are_near_the_float32_ones_and_most_codes_equal(enc, preset):
    """Same weights, same audio: TF32 moves the pre-VQ features (so the option is in effect) by at most ~1e-3 of
    their scale, and the nearest codebook entry stays the same for almost every code."""
    ieee = SpeechEncoder.load(preset, device="cuda")
    tf32 = enc if preset == "tiny-random" else SpeechEncoder.load(preset, device="cuda", tf32=True)
    pcm = speech_like(6.0, seed=7)
    codes, feats = stream_encode(ieee, pcm, [1280])
    codes1, feats1 = stream_encode(tf32, pcm, [1280])
    diff = (feats1 - feats).abs().max().item()
    scale = feats.abs().max().item()
    same = sum(a == b for a, b in zip(codes, codes1, strict=True)) / len(codes)
    print(f"{preset}: {len(codes)} codes, {same:.1%} equal; features max diff {diff:.2e} of max {scale:.2e}")
    assert 0 < diff <= 5e-3 * scale
    assert same >= 0.9
