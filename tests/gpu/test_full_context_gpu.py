"""CUDA-only checks of the full-context flow: on the GPU, streamed chunk by chunk it equals the chunk model over the
whole sequence (float32: attention over gathered pages; bf16, as served: fused blocks reading the pages in place,
in bf16 or fp8),
and the decoder's streams on it give the PCM of one stream fed at once with every page back. Run on a GPU machine:
`pytest tests/gpu/test_full_context_gpu.py`. Decoders here hold a small cache (`cache_gib`): the served 40 GiB each,
held until pytest lets go of them, ran the GPU out of memory by the fourth.
On CPU-only CI every test here is skipped with the reason below (the CPU path: tests/engines/speech_out/flow/)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.speech_out import CodecDecoder
from engines.speech_out.flow.full_context import FullContextFlow
from tests.engines.speech_out.decoder_rounds import in_rounds
from tests.engines.speech_out.flow.full_answers import alone

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CPU paths are covered by "
                                "tests/engines/speech_out/flow/test_full_context.py")


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())


@pytest.mark.parametrize(("codec", "dtype", "cache", "tol", "tf32"), [
    ("tiny-random", "float32", None, 1e-3, False),
    ("tiny-random", "bfloat16", None, 3e-2, False),
    ("full-random", "bfloat16", None, 3e-2, False),
    ("full-random", "bfloat16", None, 3e-2, True),  # as served: the encoder's products on TF32, its key factors fp16
    ("full-random", "bfloat16", torch.float8_e4m3fn, 3e-2, False)])
def test_streamed_equals_the_whole_sequence_on_the_gpu(codec, dtype, cache, tol, tf32):
    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", estimator_dtype=dtype, context="window",
                            encoder_tf32=tf32)
    fc = FullContextFlow(dec.flow, 64, cache_dtype=cache)
    a, voice, pcodes, pmel, codes = alone(fc, dec.flow, 23, 33, seed=5)  # 7 chunks after a prompt with a tail of 3
    got, want = torch.cat(a.mel, 1), a.reference(dec.flow, pcodes, pmel, codes)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert _rel_rms(got, want) < tol, _rel_rms(got, want)
    # (a broken cache or mask is off by the signal's own size, not by rounding)
    fc.close(a.state)
    fc.forget_voice(voice)
    assert fc.pages.n_free == fc.pages.n_pages


@pytest.mark.parametrize("way", ["in_place", "grouped"])
def test_streams_in_rounds_equal_each_alone_and_give_their_pages_back(way, monkeypatch):
    """in_place: the encoder's attention reads each answer's keys where they are (as served on CUDA); grouped: the
    keys gathered into batch tensors instead, budgeted so that rounds go through the encoder in groups of rows
    (FullContextFlow's encoder_batch_bytes)."""
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, cache_gib=0.05)
    calls: list[int] = []
    jobs: list[int] = []
    if way == "grouped":
        dec.full.factors = None
        dec.full.encoder_batch_bytes = 2 * 20 * dec.full.code_key_bytes  # two rows of the tiny voice's 20 codes
        encode, groups = dec.full._encode, dec.full._encode_groups
        monkeypatch.setattr(dec.full, "_encode", lambda states, *a: calls.append(len(states)) or encode(states, *a))
        monkeypatch.setattr(dec.full, "_encode_groups", lambda states, *a: jobs.append(len(states)) or groups(states,
                                                                                                             *a))
    else:
        encode = dec.full._encode_rows
        monkeypatch.setattr(dec.full, "_encode_rows", lambda states, *a: calls.append(len(states)) or encode(states,
                                                                                                           *a))
    lengths = [13, 27, 9]
    codes = [np.random.default_rng(i).integers(0, 16384, n) for i, n in enumerate(lengths)]
    each = [dec.stream_all(c, seed=i) for i, c in enumerate(codes)]
    streams = [dec.open_stream(f"s{i}", seed=i) for i in range(len(codes))]
    for s, c in zip(streams, codes, strict=True):
        s.add(c)
    got, sizes = in_rounds(dec, streams)
    assert max(sizes) == len(codes)
    if way == "grouped":
        assert len(calls) > len(jobs) and max(calls) > 1  # some batch in several encoder calls
    else:
        assert max(calls) > 1  # batches read in place
    for g, w, n in zip(got, each, lengths, strict=True):
        assert g.shape == (n * 1920,)
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
    for s in streams:
        s.close()
    held = len(dec.prepared(dec.default_voice).pages)  # the default voice's, held by the decoder's cache
    assert dec.full.pages.n_free == dec.full.pages.n_pages - held
    dec.full.pages.check()


@pytest.mark.parametrize(("dtype", "cache"), [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_graphed_solve_and_encoder_equal_eager_and_capture_per_table_width(dtype, cache):  # bf16: pages in place
    eager = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", estimator_dtype=dtype, cache_gib=0.5,
                              cache_dtype=cache)
    graphed = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, estimator_dtype=dtype,
                                cache_gib=0.5, cache_dtype=cache)
    codes = np.random.default_rng(4).integers(0, 16384, 93)  # past 16 pages: a second pages bucket
    want, got = eager.stream_all(codes, seed=2), graphed.stream_all(codes, seed=2)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    pages = {k[6][0] for k in graphed.full_graphs.graphs}  # the table's [pages] per captured key
    # Reading pages in place, one width (the pool's) serves every length; a gathering pass reads buckets of 16.
    assert pages == ({graphed.full.pages.n_pages} if dtype == "bfloat16" else {16, 32}), pages
    assert {k[1][1] for k in graphed.full_graphs.graphs} == {20, 40}  # chunks, and the first job's two in one pass
    # The encoder's graphs: one per job size (codes and lookahead), whatever the answer's length.
    assert {k[1] for k in graphed.full_enc_graphs.graphs} >= {(5 + 3,), (10 + 3,)}
    lane = graphed.lane()
    assert lane.full_graphs is not graphed.full_graphs and lane.full is graphed.full  # own graphs, shared pages
    assert lane.full_enc_graphs not in (None, graphed.full_enc_graphs)


def test_a_voice_made_on_another_thread_serves_a_stream_on_this_one():
    """The engine makes session voices on its voice worker (`warm_voice`: its own stream, waited for): a stream
    opened later on the loop's thread decodes as with a voice made in place."""
    import threading

    from engines.speech_out import Voice

    voice = Voice.random(seed=21, n_codes=43)
    codes = np.random.default_rng(8).integers(0, 16384, 31)
    here = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, cache_gib=0.5)
    want = here.stream_all(codes, voice=voice, seed=1)
    there = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, cache_gib=0.5)
    t = threading.Thread(target=there.warm_voice, args=(voice,))
    t.start()
    t.join()
    made = there.prepared(voice)  # from the cache: not made again
    assert made is there.prepared(voice) and len(made.pages) == 8
    np.testing.assert_allclose(there.stream_all(codes, voice=voice, seed=1), want, atol=1e-4, rtol=0)


def test_an_answer_in_the_default_voice_replays_only_graphs_captured_at_load():
    """A capture while serving stalls the codec for 0.8-1.6 s: every graph an answer in the default voice needs (its
    first job's solve and the vocoder over that job's answer codes, its chunks, its last partial chunk) is captured
    by `capture_graphs` (the encoder's last partial chunk runs eagerly). A prompt of 43 codes leaves a tail of 3: the
    first job renders 7 answer codes, not a chunk."""
    from engines.speech_out import Voice

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, cache_gib=0.5)
    dec.default_voice = Voice.random(seed=3, n_codes=43)
    dec.capture_graphs(2)
    captured = {g: set(g.graphs) for g in (dec.full_graphs, dec.full_enc_graphs, dec.vocoder.graphs)}
    codes = np.random.default_rng(6).integers(0, 16384, 24)  # the first job's 7, three chunks and a last 2
    assert dec.stream_all(codes, seed=1).shape == (24 * 1920,)
    for g, keys in captured.items():
        assert set(g.graphs) == keys, (type(g).__name__, set(g.graphs) - keys)


def test_a_long_answer_in_a_voice_of_another_tail_replays_only_graphs_captured_at_load():
    """As served (bf16, attention reading pages in place), a graph of a batch serves every answer length and every
    voice: an answer past the 24 s the load captures for, in a voice whose tail (6 codes) makes a first job of three
    chunks where the default voice's (3 codes) makes one of two, captures nothing while serving."""
    from engines.speech_out import Voice

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, estimator_dtype="bfloat16",
                            cache_gib=0.5)
    dec.default_voice = Voice.random(seed=3, n_codes=43)
    dec.capture_graphs(2)
    captured = {g: set(g.graphs) for g in (dec.full_graphs, dec.full_enc_graphs, dec.vocoder.graphs)}
    voice = Voice.random(seed=4, n_codes=46)
    assert len(dec.prepared(voice).tail) == 6
    codes = np.random.default_rng(7).integers(0, 16384, 400)  # 32 s at 12.5 codes a second: 88 pages with the voice
    assert dec.stream_all(codes, voice=voice, seed=1).shape == (400 * 1920,)
    for g, keys in captured.items():
        assert set(g.graphs) == keys, (type(g).__name__, set(g.graphs) - keys)


def test_answers_that_forget_their_oldest_chunks_replay_the_graphs_as_they_run_eagerly():
    """A cache always short (low water at its size): long answers in rounds forget their oldest chunks as they go,
    at the same points with and without CUDA graphs (the graphs read shorter page tables), and give the same PCM."""
    codes = [np.random.default_rng(20 + i).integers(0, 16384, n) for i, n in enumerate((60, 47, 33))]
    got = []
    for graphs in (False, True):
        dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=graphs, cache_gib=0.05)
        dec.full.kept_pages, dec.full.low_water = 4, dec.full.pages.n_pages
        streams = [dec.open_stream(f"s{i}", seed=i) for i in range(len(codes))]
        for s, c in zip(streams, codes, strict=True):
            s.add(c)
        pcm, _ = in_rounds(dec, streams)
        assert dec.full.forgotten > 0 and [p.shape for p in pcm] == [(len(c) * 1920,) for c in codes]
        for s in streams:
            s.close()
        dec.check_idle_cache()
        got.append((pcm, dec.full.forgotten))
    (eager, f0), (graphed, f1) = got
    assert f0 == f1
    for e, g in zip(eager, graphed, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=0)


def test_a_decoder_loaded_without_a_cache_size_takes_its_share_of_the_free_memory(monkeypatch):
    """On a GPU the default cache is default_cache_gib of the device's free memory as the decoder loads (here a free
    figure given, so that the test holds a small cache: 45% of 0.1 GiB)."""
    import engines.speech_out.decoder as decoder_mod

    monkeypatch.setattr(decoder_mod, "free_bytes", lambda device: 2**30 // 10)
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift")
    page = decoder_mod.cache_page_bytes(dec.cfg, dec.full.est_dtype)
    assert dec.full.pages.n_pages == int(decoder_mod.default_cache_gib(True, 2**30 // 10) * 2**30 // page) > 0
