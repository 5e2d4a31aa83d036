"""The speech encoder's streaming and batching tests (tests/test_codec_encoder.py) on a CUDA device: the GPU path
of a step (one pinned upload of every index and the samples, gathered rows, state rows at each slot) against its own
whole-utterance and one-stream results."""

from __future__ import annotations

import pytest
import torch

from engines.codec.encoder import SpeechEncoder
from tests.test_codec_encoder import (  # noqa: F401  (collected here, with this module's CUDA `enc`)
    test_batched_step_equals_each_alone,
    test_finalize_with_the_last_samples_equals_push_then_finalize,
    test_streaming_equals_whole,
)
from tests.test_encoder_worker import (  # noqa: F401  (the same, with the CUDA `enc`: a commit in the other lane)
    test_a_commit_thread_runs_a_commit_beside_a_held_call_in_flight,
    test_with_a_commit_thread_a_commit_waits_for_the_held_call_of_its_own_turn,
    test_with_a_commit_thread_a_quiet_turns_commit_runs_beside_the_held_call,
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


def test_step_graphs_equal_eager_steps(enc):
    """Steps of up to 4 streams replayed as CUDA graphs (buckets of streams, frames and keys; padding in the spare KV
    slot) give the eager steps' codes and features: batched, streamed with pushes in and out of the buckets, and
    across a 30 s segment."""
    from tests.test_codec_encoder import (
        BATCH_PCMS,
        BATCH_SIZES,
        FEATURE_ATOL,
        batched_encode,
        speech_like,
        stream_encode,
    )

    g = SpeechEncoder.load("tiny-random", device="cuda")
    g.reserve(4)
    assert g.capture_graphs(4) == 3 * 7 * 11  # streams 1, 2, 4; frames 1-64; keys 16-1500
    graphs = g.runner.graphs
    from engines.streams import is_urgent

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


def test_held_audio_on_a_chosen_priority_level_gives_the_same_codes():
    """--held-audio-level: the held calls' stream is at that level (not the least), and the worker's codes are still
    one stream's alone."""
    from engines.streams import level
    from tests.test_encoder_worker import test_codes_equal_one_stream_alone_and_the_commit_comes_last as same_codes

    mine = SpeechEncoder.load("tiny-random", device="cuda")
    least = level(mine.bulk_stream)
    mine.set_held_level(1)
    assert level(mine.bulk_stream) == 1 < least
    same_codes(mine, True)


def test_held_graphs_equal_eager_steps(enc):
    """--encoder-held-graphs: held steps of 9 to N streams replay graphs captured on the least priority, with the
    eager steps' codes; urgent steps of as many streams stay eager."""
    from engines.streams import is_urgent
    from tests.test_codec_encoder import held_bucket_steps

    g = SpeechEncoder.load("tiny-random", device="cuda")
    g.reserve(20)
    assert g.capture_graphs(2, held_max_batch=24) == 2 * 7 * 11 + 2 * 7 * 11  # urgent 1-2 streams; held 16, 24
    assert is_urgent(g.runner.graphs.stream) and not is_urgent(g.runner.held_graphs.stream)
    held_bucket_steps(g, enc)


@pytest.mark.parametrize("held_graphs", [0, 24])
def test_commits_beside_held_calls_on_two_threads_equal_each_session_alone(enc, held_graphs):
    """The encoder worker with a commit thread (--encoder-commit-thread): commits (urgent graphs, the high-priority
    stream; each session's last 0.3 s quiet, held back for them) run while calls of many sessions' held audio (eager,
    or held graphs: the least-priority stream) are in flight on the other thread, their kernels on the GPU at once;
    every session's codes equal its audio alone."""
    import contextlib
    import time

    import numpy as np

    from engines.service.encoder_worker import EncoderWorker
    from tests.test_codec_encoder import speech_like
    from tests.test_encoder_worker import _codes_by_key, _wait

    g = SpeechEncoder.load("tiny-random", device="cuda")
    g.reserve(24)
    g.capture_graphs(4, held_max_batch=held_graphs)
    lane, most = g._lane, [0]

    @contextlib.contextmanager
    def counted(urgent: bool, streams: int):
        with lane(urgent, streams):
            most[0] = max(most[0], len(g._busy))  # both lanes in a call at once
            yield

    g._lane = counted
    worker = EncoderWorker(g, every_s=0.0, threaded=True, commit_thread=True, hold_quiet=True)
    rng = np.random.default_rng(7)
    pcms = {f"s{i}": speech_like(float(rng.uniform(0.5, 1.6)), seed=60 + i) for i in range(20)}
    results = []
    for start in range(0, 25600, 1280):  # 80 ms pieces of every session; each commits when its audio ends
        for key, pcm in pcms.items():
            if start < pcm.size:
                worker.append(key, pcm[start:start + 1280], quiet=start + 1280 > pcm.size - 4800)  # (VAD: 0.3 s)
                if start + 1280 >= pcm.size:
                    assert worker.commit(key)
        results += worker.take_results()
        time.sleep(0.02)  # (paced: held calls keep coming while sessions commit)
    results += _wait(worker)
    worker.close()
    assert _codes_by_key(results) == {k: enc.encode(p) for k, p in pcms.items()}
    assert most[0] == 2  # some commit ran while a held call was in flight
    assert g.runner.kv.in_use == 0
