"""The engine loop's message handlers queue GPU work; they never wait for the GPU.

A synchronous copy or a read of a device value in a handler waits for everything queued on the loop's stream (a
step in flight), and every session waits for the loop meanwhile. CUDA's sync debug mode turns each such call into an
error here. (A new answer's codec stream setup had two: a tensor made from host floats, and `phase[0] = 0.0`, a copy of
a host scalar. CreateResponse averaged 1.2-2.9 ms, up to 76 ms, at 108-204 sessions on an H200; behind a queue of
big GEMMs one setup took 428 ms.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sync_debug_mode_catches_a_synchronous_copy():
    """The check itself: a tensor from host floats on the GPU is refused."""
    with no_sync(), pytest.raises(RuntimeError, match="synchroniz"):
        torch.tensor([0.5, 0.25], device="cuda")


def test_opening_an_answers_codec_stream_does_not_wait_for_the_gpu():
    from engines.speech_out.decoder import CodecDecoder

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cache_gib=0.5)  # (not the served 40 GiB)
    dec.open_stream("warm", seed=1).close()  # the voice's prompt is prepared once per voice, at its first use
    with no_sync():
        streams = [dec.open_stream(f"s{i}", seed=i) for i in range(3)]
    torch.cuda.synchronize()
    for i, s in enumerate(streams):  # streams opened so still decode: the first chunk's 5 + 3 codes give audio
        assert s.push([(37 * i + 11 * k) % 16384 for k in range(8)]).size > 0
        s.close()


def test_adding_and_extending_requests_does_not_wait_for_the_gpu():
    from engines.api import SamplingParams
    from engines.config import EngineConfig
    from engines.lm.engine import Engine
    from engines.tokens import IM_END, IM_START, audio_span_rows, text_rows

    eng = Engine.from_name("tiny-random", EngineConfig(device="cuda", dtype="float32"), seed=0)
    rows = text_rows([IM_START, 300, 301, IM_END]) + audio_span_rows([5, 6, 7]) + text_rows([IM_START, 302])
    with no_sync():
        eng.add_request("r", rows, SamplingParams(max_new_tokens=2), input_done=False)
        eng.append_input("r", text_rows([303]), input_done=True)
    out = []
    while eng.has_work():
        out += eng.step()
    assert out and out[-1].finished
