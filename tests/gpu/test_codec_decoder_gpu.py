"""CUDA-only checks of the codec decoder's windowed flow (CUDA graphs, batches decoded on another stream). Run on a
GPU machine: `pytest tests/gpu/test_codec_decoder_gpu.py`. On CPU-only CI every test here is skipped with the reason
below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.cuda.streams import driver_stream
from engines.speech_out import CodecDecoder
from tests.engines.speech_out.decoder_rounds import in_rounds, rounds_pcm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CPU paths are covered by "
                                "tests/engines/speech_out/test_decoder_*.py")
TOL = 1e-4  # float32 on GPU; kernels may differ between batch sizes and between graph and eager


def _codes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16384, n)


@pytest.mark.parametrize("vocoder", ["hift", "bigvgan"])
def test_cuda_graphs_match_eager_and_stream_matches_offline(vocoder):
    if vocoder == "bigvgan":
        pytest.importorskip("bigvgan", reason="the bigvgan vocoder needs the optional `bigvgan` package")
    eager = CodecDecoder.load("tiny-random", device="cuda", vocoder=vocoder, context="window")
    graphed = CodecDecoder.load("tiny-random", device="cuda", vocoder=vocoder, cuda_graphs=True, context="window")
    codes = _codes(23, 0)
    a = eager.stream_all(codes, seed=3)
    b = graphed.stream_all(codes, seed=3)
    assert a.shape == b.shape == (23 * 1920,)
    np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    s = graphed.open_stream("s", seed=3)
    streamed = np.concatenate([s.push(codes[i:i + 4]) for i in range(0, 23, 4)] + [s.finalize()])
    np.testing.assert_allclose(streamed, b, atol=TOL, rtol=0)


def test_rounds_on_another_stream_equal_alone_on_cuda_with_graphs():
    """Batches of sessions opened on the current stream and decoded on another (as on the codec worker's) give each
    session its PCM alone."""
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, context="window")
    assert dec.flow.enc_graphs is not None  # the flow's encoder replays too (as in the server)
    lengths = [13, 21, 9]
    alone = [dec.stream_all(_codes(n, i), seed=i) for i, n in enumerate(lengths)]
    streams = [dec.open_stream(f"s{i}", seed=i) for i in range(len(lengths))]
    for i, (s, n) in enumerate(zip(streams, lengths, strict=True)):
        s.add(_codes(n, i))
    with torch.cuda.stream(driver_stream("cuda")):
        got, sizes = in_rounds(dec, streams)
    assert max(sizes) == 3
    for i in range(3):
        np.testing.assert_allclose(got[i], alone[i], atol=TOL, rtol=0)


def test_full_random_chunk_runs_bf16():
    dec = CodecDecoder.load("full-random", device="cuda", vocoder="hift", cuda_graphs=True,
                            estimator_dtype="bfloat16", context="window")
    s = dec.open_stream("f", seed=0)
    out = s.push(_codes(8, 1))
    assert out.shape == (5 * 1920 - 2 * 480,) and np.isfinite(out).all()


@pytest.mark.parametrize("parts", [1, 3])
def test_precaptured_graphs_serve_steady_chunks_and_match_eager(parts):
    """parts: FlowModel.solve_parts (3: a graph per Euler step of tiny-random's 3, as rounds of playing answers)."""
    eager = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", context="window")
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, encoder_graphs=True,
                            context="window")
    dec.flow.solve_parts = parts
    # The encoder's prefix lengths for the default voice (25 prompt codes): (32, 128), (64, 160), (64, 192).
    n_enc = len(dec.flow.enc_graphs.prefix_lengths(dec.prepared(dec.default_voice).n_codes))
    assert n_enc == 3
    # Buckets 1, 2, 4 of the Euler solve (each piece) and the vocoder, and of the encoder at each prefix length.
    assert dec.capture_graphs(3, partial_chunks=False) == 3 * parts + 3 + 3 * n_enc
    assert dec.capture_graphs(3) == 6 * (dec.cfg.stream.chunk_codes - 1)  # then every shorter last chunk
    assert dec.capture_graphs(3) == 0  # already there
    # Full chunks at batches 1, 2, 3 (FINE_BUCKETS), shorter last chunks at the powers of two 1, 2, 4.
    full = dec.cfg.stream.chunk_codes * dec.cfg.flow.token_mel_ratio
    assert sorted({k[0] for k in dec.flow.graphs.graphs if k[1][1] == full}) == [1, 2, 3]
    assert sorted({k[0] for k in dec.flow.graphs.graphs if k[1][1] != full}) == [1, 2, 4]
    steady, voc_steady = set(dec.flow.graphs.graphs), set(dec.vocoder.graphs.graphs)
    enc_steady = set(dec.flow.enc_graphs.graphs)
    eager_chunks = []
    real_encode = dec.flow.encode  # EncoderGraphs holds its own reference: this only sees eager calls

    def spy(*args):
        eager_chunks.append(args[0].shape[1] - dec.cfg.flow.pre_lookahead)
        return real_encode(*args)

    dec.flow.encode = spy
    codes = _codes(22, 5)  # full chunks, then a last chunk of 2 codes at finalize
    s = dec.open_stream("p", seed=2)
    got = np.concatenate([s.push(codes[i:i + 5]) for i in range(0, 20, 5)] + [s.push(codes[20:]), s.finalize()])
    del dec.flow.encode
    assert set(dec.flow.graphs.graphs) == steady  # no capture while decoding
    assert set(dec.vocoder.graphs.graphs) == voc_steady
    assert set(dec.flow.enc_graphs.graphs) == enc_steady
    assert eager_chunks == [2]  # only the last partial chunk ran the encoder eagerly
    e = eager.open_stream("p", seed=2)
    want = np.concatenate([e.push(codes[i:i + 5]) for i in range(0, 20, 5)] + [e.push(codes[20:]), e.finalize()])
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_a_round_runs_the_smallest_captured_graph_that_holds_it_and_equals_each_session_alone():
    """Five sessions' full chunks in one call replay the graphs captured for 6 (FINE_BUCKETS; a power of two would
    be 8), and each session's PCM equals its eager decode alone. The counts name what ran."""
    eager = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", context="window")
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, context="window")
    dec.capture_graphs(6, partial_chunks=False)
    chunk = dec.cfg.stream.chunk_codes
    codes = [_codes(3 * chunk + dec.cfg.flow.pre_lookahead, i) for i in range(5)]  # three full chunks each
    jobs = []
    for i, c in enumerate(codes):
        s = dec.open_stream(f"s{i}", seed=i)
        s.add(c)
        jobs.append(s.take_jobs())
    before = set(dec.flow.graphs.graphs)
    dec.take_counts()
    got = [dec.run_jobs([js[r] for js in jobs]) for r in range(3)]  # rounds of the five sessions' r-th chunks
    assert set(dec.flow.graphs.graphs) == before  # nothing captured: five sessions ran the graphs of 6
    c = dec.take_counts()
    assert (c.solves, c.partial, c.rows, c.padded_rows) == (3, 0, 15, 18)
    for i, cs in enumerate(codes):
        want = eager.open_stream(f"s{i}", seed=i).push(cs)
        np.testing.assert_allclose(np.concatenate([g[i] for g in got]), want, atol=TOL, rtol=0)


def test_encoder_tf32_stays_near_float32_and_streams_like_offline():
    """The flow encoder's matmuls on TF32 (the server's setting): the PCM moves (the switch reaches cuBLAS) but stays
    within 1e-3 of the float32 encoder's (1.3e-4 measured on an H200), and streaming still equals offline."""
    kw = dict(device="cuda", vocoder="hift", cuda_graphs=True, estimator_dtype="bfloat16")
    f32 = CodecDecoder.load("full-random", **kw, context="window")
    t32 = CodecDecoder.load("full-random", encoder_tf32=True, **kw, context="window")
    codes = _codes(23, 0)
    a = f32.stream_all(codes, seed=3)
    b = t32.stream_all(codes, seed=3)
    assert 0 < np.abs(a - b).max() < 1e-3
    s = t32.open_stream("s", seed=3)
    streamed = np.concatenate([s.push(codes[i:i + 5]) for i in range(0, 23, 5)] + [s.finalize()])
    np.testing.assert_allclose(streamed, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("codec", ["tiny-random", "full-random"])
def test_vocoder_graph_replay_equals_eager(codec):
    """The HiFT generator replayed from a graph (padded batch 3 -> 4) gives the eager result on the same inputs, and
    the graph reads its noise input (a different noise changes the output)."""
    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", cuda_graphs=True, context="window")
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


def _encoder_inputs(dec: CodecDecoder, seed: int) -> tuple[torch.Tensor, ...]:
    """FlowModel.encode's inputs for the next full chunk of 3 sessions at different points (different voices and
    windows, so prefix lengths and padding differ per row)."""
    from engines.speech_out import Voice

    flow, la = dec.flow, dec.cfg.flow.pre_lookahead
    states = []
    for i, (voice, done) in enumerate([(None, 15), (Voice.random(seed=5, n_codes=3), 5), (Voice.empty(), 0)]):
        s = dec.open_stream(f"e{i}", voice=voice, seed=i)
        s.push(_codes(done + la, seed + i))
        assert s.flow_state.codes_done == done
        states.append(s.flow_state)
    codes = torch.as_tensor(np.stack([_codes(5 + la, seed + 10 + i) for i in range(3)]))
    return flow.encode_inputs(states, codes, 5, [la, 1, 0])


@pytest.mark.parametrize("codec", ["tiny-random", "full-random"])
def test_encoder_graph_replay_equals_eager(codec):
    """FlowModel.encode replayed from a graph (batch 3 padded to 4 by repeating the last row) gives the eager result,
    and the graph reads its inputs (other codes, other outputs; the same graph serves both)."""
    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", cuda_graphs=True, encoder_graphs=True,
                            context="window")
    graphs, dec.flow.enc_graphs = dec.flow.enc_graphs, None  # the sessions' earlier chunks run eagerly
    with torch.inference_mode():
        args = _encoder_inputs(dec, 0)
        want = dec.flow.encode(*args)
        got = graphs.run(*args)
        again = graphs.run(*args)
        other_args = list(args)
        other_args[0] = (args[0] + 1) % 16384
        other = graphs.run(*other_args)
        other_want = dec.flow.encode(*other_args)
    assert len(graphs.graphs) == 1
    # Same kernels in the graph as eagerly except where the padded batch (4 rows, not 3) picks other GEMM tiles;
    # float32 rounding through 6 + 4 conformer layers (cuDNN convolutions may use TF32 in both).
    rel = 1e-5 if codec == "tiny-random" else 1e-4
    for w, g, a, o, ow in zip(want, got, again, other, other_want, strict=True):
        assert g.shape == w.shape and g.shape[0] == 3
        tol = rel * max(float(w.abs().max()), 1.0)
        torch.testing.assert_close(g, w, atol=tol, rtol=0)
        torch.testing.assert_close(a, g, atol=tol, rtol=0)
        torch.testing.assert_close(o, ow, atol=tol, rtol=0)
    assert (other[0] - got[0]).abs().max() > 1e-4  # mu follows the codes


def test_state_made_on_one_stream_decodes_on_another():
    """The engine loop opens a decode stream on its CUDA stream and the codec worker decodes it on another: the
    decode must wait for the kernels that made the state (here held back behind a long sleep kernel) and the
    state is handed to the decoding stream once (DecodeStream.adopt)."""
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, context="window")
    codes = _codes(17, 5)
    want = dec.stream_all(codes, seed=4)
    opener, worker = torch.cuda.Stream(), torch.cuda.Stream()
    make_voc_state = dec.windowed.new_state

    def late_voc_state(*a, **k):
        # The vocoder state's kernels (no host sync among them) queue behind ~0.1 s of GPU time on the opener.
        torch.cuda._sleep(200_000_000)
        return make_voc_state(*a, **k)

    dec.windowed.new_state = late_voc_state
    with torch.cuda.stream(opener):
        s = dec.open_stream("other-stream", seed=4)
    del dec.windowed.new_state
    assert s.ready is not None
    with torch.cuda.stream(worker):
        s.add(codes)
        got = np.concatenate([s._run(s.take_jobs()), s.finalize()])
    assert s.ready is None
    np.testing.assert_allclose(got, want, atol=3e-4, rtol=0)


def test_first_chunk_on_a_lane_then_the_rest_on_another_stream_equals_offline():
    """The codec worker's first-chunk lane: a stream's first chunk decoded by CodecDecoder.lane on one CUDA stream,
    the rest by the decoder on another (the state changes streams: DecodeStream.adopt), equals the offline decode;
    the lane replays graphs of its own."""
    from engines.lm.step_graphs import private_stream

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, context="window")
    lane = dec.lane()
    codes = _codes(23, 6)
    want = dec.stream_all(codes, seed=2)
    first, rest = private_stream(), private_stream()
    s = dec.open_stream("lanes", seed=2)
    s.add(codes)
    jobs = s.take_jobs()
    with torch.cuda.stream(first):
        out = lane.run_jobs(jobs[:1])
    with torch.cuda.stream(rest):
        for j in jobs[1:]:
            out += dec.run_jobs([j])
        out.append(s.finalize())
    np.testing.assert_allclose(np.concatenate(out), want, atol=3e-4, rtol=0)
    assert lane.flow.graphs.graphs and lane.vocoder.graphs.graphs  # captured on the lane's first use
    assert lane.flow.graphs.stream.cuda_stream != dec.flow.graphs.stream.cuda_stream
    assert lane.vocoder.generator is not dec.vocoder.generator and dec.vocoder.generator._branch_streams.all()
    mine, theirs = (g.vocoder.generator._branch_streams.all() for g in (lane, dec))
    assert not {x.cuda_stream for x in mine} & {x.cuda_stream for x in theirs}
    # A new answer's first chunk is urgent, the playing rounds are not: a graph runs at its capture stream's priority.
    from engines.cuda.streams import is_urgent

    assert all(is_urgent(g.stream) for g in (lane.flow.graphs, lane.vocoder.graphs)) and all(map(is_urgent, mine))
    assert not any(is_urgent(g.stream) for g in (dec.flow.graphs, dec.vocoder.graphs))
    assert not any(map(is_urgent, theirs))


def test_two_first_lanes_on_their_threads_give_the_offline_pcm():
    """The codec worker with two first-chunk lanes (each a thread, a CUDA stream and graphs of its own) and the
    playing thread, answers arriving together so that both lanes decode at once: every answer's PCM equals its
    offline decode, and both lanes did decode."""
    import time

    from engines.process.codec_pacing import PLAYING_SOLVE_PARTS
    from engines.process.codec_worker import CodecWorker

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, context="window")
    lanes = [dec.lane(), dec.lane()]
    dec.flow.solve_parts = PLAYING_SOLVE_PARTS  # as the engine process sets them, graphs captured before serving
    dec.capture_graphs(4)  # (as the engine process does: every lane's graphs at load, none while serving)
    for lane in lanes:
        lane.flow.solve_parts = 1
        lane.capture_graphs(4)
    calls = {id(lane): 0 for lane in lanes}

    def counted(lane):
        run = lane.run_jobs

        def run_jobs(jobs, between=None):
            calls[id(lane)] += 1
            time.sleep(0.05)  # hold this lane, so the next answer finds it busy and takes the other
            return run(jobs, between)
        return run_jobs

    for lane in lanes:
        lane.run_jobs = counted(lane)
    codes = {f"s{i}": _codes(n, 10 + i) for i, n in enumerate((23, 17, 31, 12))}
    want = {sid: dec.stream_all(c, seed=i) for i, (sid, c) in enumerate(codes.items())}
    w = CodecWorker(dec, torch.device("cuda"), first_decoders=lanes)
    streams = {sid: dec.open_stream(sid, seed=i) for i, sid in enumerate(codes)}
    out: dict[str, list] = {sid: [] for sid in codes}
    for sid, c in codes.items():
        w.push(sid, streams[sid], c[:8].tolist())
        time.sleep(0.01)
    for sid, c in codes.items():
        w.push(sid, streams[sid], c[8:].tolist(), final=True)
    deadline, finals = time.monotonic() + 120, 0
    while finals < len(codes) and time.monotonic() < deadline:
        for key, pcm, final in w.take_results():
            assert isinstance(pcm, np.ndarray), pcm
            out[key].append(pcm)
            finals += final
        time.sleep(0.005)
    w.close()
    assert finals == len(codes)
    for sid in codes:
        np.testing.assert_allclose(np.concatenate(out[sid]), want[sid], atol=3e-4, rtol=0)
    assert all(n >= 1 for n in calls.values()), calls


@pytest.mark.parametrize("context", ["full", "window"])
def test_rounds_queued_ahead_on_cuda_equal_rounds_one_after_another(context):
    """Each round queued on a driver stream before the one before it is collected (its work still in flight when
    the next is queued), with CUDA graphs: the PCM of rounds run one after another, held tails included."""
    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", cuda_graphs=True, context=context)
    with torch.cuda.stream(driver_stream(dec.device)):
        ahead = rounds_pcm(dec, (23, 17, 9), True)
        serial = rounds_pcm(dec, (23, 17, 9), False)
    for a, s in zip(ahead, serial, strict=True):
        assert a.shape == s.shape and a.size > 0
        np.testing.assert_allclose(a, s, atol=TOL, rtol=0)
