"""SM partitions (engines.partition): the codec's and the language model's kernels run on disjoint SMs, streams made
while a partition's stream is current stay in it, and so do graphs captured on them; results do not change."""

from __future__ import annotations

import argparse
import functools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
triton = pytest.importorskip("triton", reason="the SM probe is a Triton kernel")
tl = pytest.importorskip("triton.language")


@triton.jit
def _smid_kernel(out_ptr):
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out_ptr + tl.program_id(0), smid)


def _sms_used(stream: torch.cuda.Stream, programs: int = 4096) -> set[int]:
    """The SMs a launch of many programs on `stream` ran on."""
    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _smid_kernel[(programs,)](out)
    stream.synchronize()
    return set(out.tolist())


@functools.cache
def _split():
    from engines.partition import split

    return split("cuda", 32)


def _total() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def test_split_partitions_are_disjoint_and_sized():
    sms = _split()
    assert sms.codec_sms >= 32 and sms.codec_sms + sms.lm_sms == _total()
    codec, lm = _sms_used(sms.stream("codec")), _sms_used(sms.stream("lm", urgent=True))
    assert len(codec) == sms.codec_sms and len(lm) == sms.lm_sms
    assert not codec & lm
    assert len(_sms_used(torch.cuda.Stream())) == _total()  # the primary context keeps every SM


def test_streams_made_under_a_partition_stay_in_it():
    from engines.graphs import private_stream
    from engines.partition import driver_stream, green_context, sm_count
    from engines.streams import high_priority_stream

    sms = _split()
    home = sms.stream("codec")
    codec = _sms_used(home)
    with torch.cuda.stream(home):
        made = [private_stream(), high_priority_stream("cuda"), driver_stream(urgent=False)]
        assert sm_count(torch.device("cuda")) == sms.codec_sms
    assert sm_count(torch.device("cuda")) == _total()
    made.append(driver_stream("cuda", like=home))
    for s in made:
        assert green_context(s) == sms.codec
        assert _sms_used(s) <= codec
    assert green_context(private_stream()) is None  # made under the primary context's current stream


def test_private_streams_take_the_priority_asked_or_the_current_streams():
    """A graph's kernels run at its capture stream's priority (engines.graphs.private_stream): capture streams and
    the side streams forked inside a capture are urgent exactly when asked, or when the stream they are made under
    is."""
    from engines.graphs import SideStreams, private_stream
    from engines.partition import is_urgent
    from engines.streams import high_priority_stream

    assert is_urgent(private_stream(urgent=True)) and not is_urgent(private_stream(urgent=False))
    assert not is_urgent(private_stream())  # made under the default stream
    side = SideStreams()
    with torch.cuda.stream(high_priority_stream("cuda")):
        assert is_urgent(private_stream()) and not is_urgent(private_stream(urgent=False))
        hi = side.get("cuda", 2)
        assert side.get("cuda", 1) == hi[:1]  # made once per priority
    lo = side.get("cuda", 3)
    assert all(map(is_urgent, hi)) and not any(map(is_urgent, lo)) and len(side.all()) == 5


def test_model_stream_sits_between_the_urgent_and_the_playing_rounds():
    """The model's steps run one level below the commits and first chunks and above the playing rounds; what is made
    under its stream (its graphs' capture streams, their side branches) takes that exact priority."""
    from engines.graphs import SideStreams, private_stream
    from engines.partition import is_urgent, level
    from engines.streams import high_priority_stream, model_stream

    model, urgent, low = model_stream("cuda"), high_priority_stream("cuda"), private_stream(urgent=False)
    assert level(urgent) < level(model) < level(low) and not is_urgent(model)
    side = SideStreams()
    with torch.cuda.stream(model):
        made = [private_stream(), *side.get("cuda", 2)]
    with torch.cuda.stream(urgent):
        made_urgent = side.get("cuda", 1)
    assert [level(s) for s in made] == [level(model)] * 3
    assert level(made_urgent[0]) == level(urgent) and len(side.all()) == 3


def test_graph_captured_in_a_partition_replays_there_from_any_stream():
    from engines.graphs import capture_graph, private_stream

    sms = _split()
    home = sms.stream("codec")
    codec = _sms_used(home)
    out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(home):
        graph, _ = capture_graph(lambda: _smid_kernel[(4096,)](out), private_stream())
    out.fill_(-1)
    graph.replay()  # on the primary context's current stream
    torch.cuda.synchronize()
    assert set(out.tolist()) <= codec


def test_codec_solve_in_a_partition_equals_the_whole_gpu():
    """The served solve graph (bf16 estimator, Triton kernels, PDL) captured in the codec's partition gives the same
    mel, bit for bit, as captured on the whole GPU."""
    from engines.codec.decoder import CodecDecoder
    from engines.codec.decoder.graphs import EulerGraphs

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True,
                            estimator_dtype="bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(s, device="cuda", dtype=dec.flow.dtype, generator=gen)
              for s in EulerGraphs(dec.flow).input_shapes(2)]
    with torch.inference_mode():
        want, _ = EulerGraphs(dec.flow).run(*inputs)
        with torch.cuda.stream(_split().stream("codec")):
            graphs = EulerGraphs(dec.flow)
            got, _ = graphs.run(*inputs)
        torch.cuda.synchronize()
    from engines.partition import green_context

    assert green_context(graphs.stream) == _split().codec
    assert torch.equal(got, want)


@pytest.mark.parametrize("only", [False, True], ids=["codec-on-every-sm", "codec-sms-only"])
def test_service_with_codec_sms_puts_codec_and_model_in_their_partitions(only):
    """`--codec-sms`: the model's graphs and the speech encoder run in the model's partition; the codec's graphs and
    worker rounds (here with a first-chunk lane too) in the primary context (every SM), or with `--codec-sms-only`
    in the codec's partition; spoken turns still answer."""
    pytest.importorskip("zmq", reason="engines.service.process needs pyzmq: on the GPU box carry .whl and put "
                                      "PYTHONPATH=/tmp/site after docs/bench/gpu_capacity.sh's install")
    from engines.partition import green_context
    from engines.service.process import add_arguments, build_service

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "cuda", "--model", "tiny-random", "--codec", "tiny-random", "--vocoder", "hift",
                         "--codec-sms", "32", "--no-warm-up", "--first-lane"] + (["--codec-sms-only"] if only else []))
    prev = torch.cuda.current_stream()
    svc = None
    try:
        svc = build_service(args)
        lm_ctx = green_context(torch.cuda.current_stream())
        assert lm_ctx is not None
        assert green_context(svc.engine.runner.graphs.stream) == lm_ctx
        assert green_context(svc.encoder.stream) == lm_ctx
        codec_ctx = green_context(svc._codec._stream)
        assert (codec_ctx not in (None, lm_ctx)) if only else codec_ctx is None
        assert green_context(svc._codec._first_stream) == codec_ctx
        assert green_context(svc.decoder.flow.graphs.stream) == codec_ctx
        assert svc._codec.first_decoder is not None
        assert green_context(svc._codec.first_decoder.flow.graphs.stream) == codec_ctx
        svc.warm_up(batches=(1, 2), rows=12)  # raises if a turn fails or does not finish
    finally:
        if svc is not None and svc._codec is not None:
            svc._codec.close()
        torch.cuda.set_stream(prev)
