"""CUDA-only checks of the codec decoder (CUDA graphs, the task's side stream). Run on a GPU machine:
`pytest tests/gpu/test_codec_decoder_gpu.py`. On CPU-only CI every test here is skipped with the reason below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.codec.decoder import CodecDecoder, CodecTask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CPU paths are covered by "
                                "tests/test_codec_decoder.py")
TOL = 1e-4  # float32 on GPU; kernels may differ between batch sizes and between graph and eager


def _codes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16384, n)


@pytest.mark.parametrize("vocoder", ["hift", "bigvgan"])
def test_cuda_graphs_match_eager_and_stream_matches_offline(vocoder):
    if vocoder == "bigvgan":
        pytest.importorskip("bigvgan", reason="the bigvgan vocoder needs the optional `bigvgan` package")
    eager = CodecDecoder.load("tiny-random", device="cuda", vocoder=vocoder)
    graphed = CodecDecoder.load("tiny-random", device="cuda", vocoder=vocoder, cuda_graphs=True)
    codes = _codes(23, 0)
    a = eager.decode(codes, seed=3)
    b = graphed.decode(codes, seed=3)
    assert a.shape == b.shape == (23 * 1920,)
    np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    s = graphed.open_stream("s", seed=3)
    streamed = np.concatenate([s.push(codes[i:i + 4]) for i in range(0, 23, 4)] + [s.finalize()])
    np.testing.assert_allclose(streamed, b, atol=TOL, rtol=0)


def test_task_batch_equals_alone_on_cuda_with_graphs():
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True)
    lengths = [13, 21, 9]
    alone = [dec.decode(_codes(n, i), seed=i) for i, n in enumerate(lengths)]
    task = CodecTask(dec, max_batch=8)
    got: dict[str, list[np.ndarray]] = {}
    for i, n in enumerate(lengths):
        task.open(f"s{i}", seed=i)
        task.submit(f"s{i}", _codes(n, i))
        task.finish(f"s{i}")
    while task.pending():
        for sid, pcm in task.step().items():
            got.setdefault(sid, []).append(pcm)
    for i in range(3):
        np.testing.assert_allclose(np.concatenate(got[f"s{i}"]), alone[i], atol=TOL, rtol=0)


def test_full_random_chunk_runs_bf16():
    dec = CodecDecoder.load("full-random", device="cuda", vocoder="hift", cuda_graphs=True,
                            estimator_dtype="bfloat16")
    s = dec.open_stream("f", seed=0)
    out = s.push(_codes(8, 1))
    assert out.shape == (5 * 1920 - 2 * 480,) and np.isfinite(out).all()


def test_precaptured_graphs_serve_steady_chunks_and_match_eager():
    eager = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift")
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True)
    assert dec.capture_graphs(3, partial_chunks=False) == 6  # buckets 1, 2, 4 of the Euler solve and the vocoder
    assert dec.capture_graphs(3) == 6 * (dec.cfg.stream.chunk_codes - 1)  # then every shorter last chunk
    assert dec.capture_graphs(3) == 0  # already there
    steady, voc_steady = set(dec.flow.graphs.graphs), set(dec.vocoder.graphs.graphs)
    codes = _codes(22, 5)  # full chunks, then a last chunk of 2 codes at finalize
    s = dec.open_stream("p", seed=2)
    got = np.concatenate([s.push(codes[i:i + 5]) for i in range(0, 20, 5)] + [s.push(codes[20:]), s.finalize()])
    assert set(dec.flow.graphs.graphs) == steady  # no capture while decoding
    assert set(dec.vocoder.graphs.graphs) == voc_steady
    e = eager.open_stream("p", seed=2)
    want = np.concatenate([e.push(codes[i:i + 5]) for i in range(0, 20, 5)] + [e.push(codes[20:]), e.finalize()])
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("codec", ["tiny-random", "full-random"])
def test_vocoder_graph_replay_equals_eager(codec):
    """The HiFT generator replayed from a graph (padded batch 3 -> 4) gives the eager result on the same inputs, and
    the graph reads its noise input (a different noise changes the output)."""
    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", cuda_graphs=True)
    voc, g = dec.vocoder, dec.vocoder.generator
    st = dec.cfg.stream
    T = st.voc_ctx_frames + st.chunk_codes * dec.cfg.flow.token_mel_ratio
    gen = torch.Generator(device="cuda").manual_seed(0)
    mel = torch.randn(3, 80, T, device="cuda", generator=gen) - 5
    phase = torch.rand(3, g.n_harmonics, device="cuda", generator=gen)
    noise = voc.noise([gen] * 3, T, "cuda", torch.float32)
    keep = (T - st.voc_ctx_frames) * voc.mel.hop
    with torch.inference_mode():
        want = g(mel, phase, noise, keep)
        got = voc.graphs.run([mel, phase, noise], (keep,))
        again = voc.graphs.run([mel, phase, noise], (keep,))
        other = voc.graphs.run([mel, phase, noise + 1.0], (keep,))
    assert len(voc.graphs.graphs) == 1
    # cuDNN / cuFFT may pick other algorithms inside a capture than eagerly: at full size (float32, ~30 conv
    # layers) samples then differ by up to ~1e-4 (measured 8.4e-5 on an H200), at tiny size by < 1e-5.
    tol = 1e-5 if codec == "tiny-random" else 3e-4
    for a, b, c in zip(want, got, again, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=tol, rtol=0)
        torch.testing.assert_close(c, b, atol=tol, rtol=0)  # F.fold adds with atomics: not bitwise repeatable
    assert (other[0] - got[0]).abs().max() > 1e-6
