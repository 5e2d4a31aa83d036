"""Speech encoder step buckets: steps padded to the captured graphs' buckets equal exact ones, across the 30 s
segment, held steps replay the buckets, and a KV pool growth retires the graphs."""

from __future__ import annotations

import pytest
import torch

from engines.speech_in import SpeechEncoder
from tests.engines.speech_in.encoder_helpers import (
    BATCH_PCMS,
    BATCH_SIZES,
    FEATURE_ATOL,
    EagerStepGraphs,
    batched_encode,
    bucketed_encoder,
    speech_like,
    stream_encode,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bucketed_steps_equal_exact_ones(enc):
    """Steps padded to a graph's bucket (more streams, frames and keys than the step has; padding in the spare KV
    slot) give the codes and features of the exact shapes; steps without a bucket (a 1.5 s push: 75 frames) run
    exactly."""
    e = bucketed_encoder()
    graphs = e.runner.graphs
    pcms = [speech_like(t, seed=seed) for t, seed in BATCH_PCMS]
    exact = batched_encode(enc, pcms, BATCH_SIZES)
    for (codes, feats), (codes1, feats1) in zip(batched_encode(e, pcms, BATCH_SIZES), exact, strict=True):
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)
    assert graphs.replays > 10
    pcm = speech_like(2.3)
    replays = graphs.replays
    codes, feats = stream_encode(e, pcm, [24000, 320])
    # Pushes of 24000, 320 and the last 12480 samples (75, 2 and 39 frames), then the finalize: three in buckets.
    assert graphs.replays - replays == 3
    codes1, feats1 = stream_encode(enc, pcm, [24000, 320])
    assert codes == codes1
    torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)


def test_bucketed_steps_across_30s_segment(enc):
    e = bucketed_encoder(1)
    pcm = speech_like(31.0, seed=3)
    codes, feats = stream_encode(e, pcm, [8000, 4321])
    codes1, feats1 = stream_encode(enc, pcm, [8000, 4321])
    assert codes == codes1
    torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)


def test_held_steps_replay_the_buckets_up_to_the_graphs_streams(enc):
    """Held audio's steps (`batch(urgent=False)`) of no more streams than the graphs hold replay their buckets, as
    urgent steps do; bigger ones run exactly. The codes equal each stream encoded alone."""
    e = SpeechEncoder.load("tiny-random", device="cpu")
    e.reserve(3)
    graphs = e.runner.graphs = EagerStepGraphs(e.runner, 2)
    graphs.capture()
    pcms = [speech_like(1.0, seed=i) for i in range(3)]
    streams = [e.open_stream() for _ in pcms]
    three = e.batch(urgent=False).step([(s, p[:5120]) for s, p in zip(streams, pcms, strict=True)])
    assert graphs.replays == 0  # 3 streams: no bucket
    two = e.batch(urgent=False).step([(s, p[5120:10240]) for s, p in zip(streams[:2], pcms[:2], strict=True)])
    assert graphs.replays == 1
    last = e.batch().finalize(streams, [pcms[0][10240:], pcms[1][10240:], pcms[2][5120:]])
    assert graphs.replays == 1
    assert [three[i] + (two[i] if i < 2 else []) + last[i] for i in range(3)] == [enc.encode(p) for p in pcms]


def test_a_kv_pool_growth_retires_the_graphs(enc, caplog):
    e = bucketed_encoder(2)
    graphs = e.runner.graphs
    streams = [e.open_stream() for _ in range(3)]  # reserved 2: the third grows the pool
    pcm = speech_like(0.5)
    with caplog.at_level("WARNING", logger="engines.audio"):
        codes = e.batch().finalize(streams, [pcm] * 3)
    assert "grew" in caplog.text and not graphs.graphs and graphs.replays == 0
    assert codes == [enc.encode(pcm)] * 3
