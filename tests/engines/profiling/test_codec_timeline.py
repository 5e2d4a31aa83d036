"""engines/profiling/codec_timeline.py on CPU (host marks; the GPU columns need CUDA: the tool is run on a GPU)."""

import math

import pytest

from engines.profiling import codec_timeline as ct
from engines.speech_out import CodecDecoder
from engines.speech_out.decoder import CodecDecoder as DecoderClass
from engines.speech_out.queued import QueuedRound


@pytest.fixture(scope="module")
def tiny():
    return CodecDecoder.load("tiny-random", vocoder="hift", context="window")  # the tool's path


def test_a_step_is_marked_in_order_and_everything_patched_is_restored(tiny):
    wait = QueuedRound.wait
    rows = ct.timeline(tiny, batch=2, steps=3)
    names = [k for k, _, _ in rows]
    for want in ("start#0", "run_jobs>#0", "decode_chunk>#0", "_prefix_layouts>#0", "_index_arrays>#0", "_solve<#0",
                 "render>#0", "pcm_wait<#0", "finish<#0", "run_jobs<#0", "end#0"):
        assert want in names, (want, names)
    host = dict((k, h) for k, h, _ in rows)
    order = ["start#0", "run_jobs>#0", "decode_chunk>#0", "_solve<#0", "render>#0", "finish<#0", "end#0"]
    assert [host[k] for k in order] == sorted(host[k] for k in order)  # medians of marks in one order each step
    assert all(math.isnan(g) for _, _, g in rows)  # no GPU time off CUDA
    # Nothing stays patched: the instances' methods are their classes' again, the class's its own.
    assert "run_jobs" not in vars(tiny) and "decode_chunk" not in vars(tiny.flow)
    assert "render" not in vars(tiny.windowed) and QueuedRound.wait is wait
    assert tiny.run_jobs.__func__ is DecoderClass.run_jobs


def test_an_attribute_the_instance_owned_is_put_back(tiny):
    tl = ct.Timeline(cuda=False)

    class Box:
        pass

    box = Box()
    box.f = lambda x: x + 1
    own = box.f
    tl.around(box, "f", "f")
    assert box.f(1) == 2 and [m[0] for m in tl.marks] == ["f>", "f<"]
    tl.restore()
    assert box.f is own
