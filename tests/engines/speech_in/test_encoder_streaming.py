"""Causal speech encoder on the CPU: streaming equals whole, pieces and finalize equal one call, codes emitted as
soon as determined, batched steps equal each stream alone, and bad input refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engines.speech_in import (
    EncoderInputError,
    StreamClosedError,
)
from tests.engines.speech_in.encoder_helpers import (
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
    whole_encode,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("sizes", STREAM_SIZES, ids=STREAM_SIZE_IDS)
def test_streaming_equals_whole(enc, sizes):
    check_streaming_equals_whole(enc, sizes)


def test_streaming_equals_whole_across_30s_segment(enc):
    pcm = speech_like(31.0, seed=3)  # crosses the 1500-frame position limit: model state restarts at 30 s
    whole, wf = whole_encode(enc, pcm)
    assert len(whole) == 388
    codes, f = stream_encode(enc, pcm, [8000, 4321])
    assert codes == whole
    torch.testing.assert_close(f, wf, atol=FEATURE_ATOL, rtol=0)


def test_encode_in_pieces_equals_encode_and_frees_its_slot(enc):
    """A voice prompt is encoded in pieces on the low-priority lane: the same codes as one whole forward."""
    pcm = speech_like(2.3, seed=5)
    in_use = enc.runner.kv.in_use
    assert enc.encode_in_pieces(pcm, piece_samples=4000) == enc.encode(pcm)
    assert enc.encode_in_pieces(pcm[:100]) == enc.encode(pcm[:100])
    assert enc.runner.kv.in_use == in_use


def test_code_emitted_as_soon_as_determined(enc):
    pcm = speech_like(0.5)
    s = enc.open_stream()
    # Code k needs sample 1280 k + 1160: the 25 ms window of mel frame 8k+6 (conv2 stride 2, pool 4).
    assert s.push(pcm[:1159]) == []
    assert len(s.push(pcm[1159:1160])) == 1
    assert s.push(pcm[1160:2439]) == []
    assert len(s.push(pcm[2439:2440])) == 1


@pytest.mark.parametrize("split", FINALIZE_SPLITS)
def test_finalize_with_the_last_samples_equals_push_then_finalize(enc, split):
    check_finalize_with_the_last_samples_equals_push_then_finalize(enc, split)


@pytest.mark.parametrize("n", [0, 1, 1160, 1280, 1281, 5000])
def test_finalize_pads_last_group_with_silence(enc, n):
    pcm = speech_like(1.0)[:n]
    s = enc.open_stream()
    codes = s.push(pcm) + s.finalize()
    assert len(codes) == -(-n // 1280)
    # The padding is silence: encoding the zero-padded signal gives the same codes.
    padded = np.concatenate([pcm, np.zeros(s.tail_padding() + (-n) % 1280 + 200, np.float32)])
    assert enc.encode(padded)[: len(codes)] == codes
    with pytest.raises(StreamClosedError):
        s.push(pcm)
    with pytest.raises(StreamClosedError):
        s.finalize()


def test_batched_step_equals_each_alone(enc):
    check_batched_step_equals_each_alone(enc)


def test_a_call_on_another_thread_leaves_this_threads_gpu_wait(enc):
    """The encoder worker reads last_gpu_wait_s after its own call; a voice prompt encoded meanwhile on another
    thread must not overwrite it."""
    enc.last_gpu_wait_s = -1.0  # (stands for the worker's last call: a value no call measures)
    theirs = []

    def other() -> None:
        s = enc.open_stream()
        enc.batch().step([(s, speech_like(0.5, seed=3))])
        theirs.append(enc.last_gpu_wait_s)
        s.close()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert enc.last_gpu_wait_s == -1.0 and theirs[0] >= 0


def test_many_streams_with_uneven_pushes_equal_each_alone(enc):
    """A step's rows, windows and kept tails are index arithmetic over every stream at once: twelve streams whose
    pushes give none, a few or many frames (some none at all in a step, some crossing a pooling group) match each
    stream encoded alone in one push."""
    pcms = [speech_like(0.4 + 0.15 * i, seed=20 + i) for i in range(12)]
    sizes = [[(0, 37, 5120, 160, 1500, 320)[(i + k) % 6] or 1 for k in range(3)] for i in range(12)]
    sizes[0] = [0, 2000]  # a stream with nothing new every other step
    alone = [whole_encode(enc, p) for p in pcms]
    for (codes, feats), (codes1, feats1) in zip(batched_encode(enc, pcms, sizes), alone, strict=True):
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)


def test_batch_refuses_duplicate_stream(enc):
    s = enc.open_stream()
    with pytest.raises(ValueError, match="twice"):
        enc.batch().step([(s, np.zeros(10, np.float32)), (s, np.zeros(10, np.float32))])


@pytest.mark.parametrize("bad, msg", [
    (np.array([0.0, np.nan], np.float32), "NaN"),
    (np.array([np.inf], np.float32), "NaN or infinite"),
    (np.zeros((2, 10), np.float32), "1-D"),
    (np.zeros(10, np.int16), "float"),
])
def test_bad_pcm_refused(enc, bad, msg):
    with pytest.raises(EncoderInputError, match=msg):
        enc.open_stream().push(bad)
