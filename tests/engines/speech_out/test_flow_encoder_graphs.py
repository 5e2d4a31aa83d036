"""The flow encoder's static shapes, which let EncoderGraphs replay it: relative positions from sin/cos factors,
prefix padding, batch padding rows, precaptured prefix lengths, bucket graphs, and graph bookkeeping and inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engines.speech_out import CodecDecoder, Voice
from tests.engines.speech_out.decoder_rounds import BATCH_TOL, _codes, in_rounds
from tests.engines.speech_out.graph_stand_in import replay_stand_in

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _table_gather_relative(attn, q: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """The former formulation, kept here as the reference: a sinusoid table over every query-key distance in
    [lo, hi], projected through linear_pos, then gathered per (query, key). q [B, T, H, dk] -> [B, H, T, K]."""
    from engines.speech_out.flow.conformer import sinusoid

    B, T, H, dk = q.shape
    dist = qpos[:, :, None] - kpos[:, None, :]  # [B, T, K]
    lo, hi = int(dist.min()), int(dist.max())
    p = attn.linear_pos(sinusoid(torch.arange(lo, hi + 1), H * dk)).view(-1, H, dk)  # [R, H, dk]
    bd_all = torch.einsum("bthd,rhd->bhtr", q + attn.pos_bias_v, p)  # [B, H, T, R]
    return bd_all.gather(-1, (dist - lo)[:, None].expand(B, H, T, kpos.shape[1]))


def _exact_relative(attn, q: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """The relative term in float64 (angles exact to ~1e-12): the ground truth both float32 forms are held to."""
    B, T, H, dk = q.shape
    D = H * dk
    w = torch.exp(torch.arange(0, D, 2, dtype=torch.float64) * (-math.log(10000.0) / D))
    ang = (qpos[:, :, None] - kpos[:, None, :]).double()[..., None] * w  # [B, T, K, D/2]
    table = torch.stack([ang.sin(), ang.cos()], -1).flatten(-2)  # [B, T, K, D]: sin on even, cos on odd channels
    g = torch.einsum("bthc,hcj->bhtj", (q + attn.pos_bias_v).double(), attn.linear_pos.weight.double().view(H, dk, D))
    return torch.einsum("bhtj,btkj->bhtk", g, table)


@torch.inference_mode()
@pytest.mark.parametrize("at", [30, 1000, 5000])
def test_relative_term_from_sin_cos_factors_equals_table_and_gather(at):
    from engines.speech_out.flow.conformer import KV, AttnContext, RelPosSelfAttention

    torch.manual_seed(0)
    D, H, T = 64, 4, 20
    attn = RelPosSelfAttention(D, H)
    attn.pos_bias_v.normal_()
    q = torch.randn(2, T, H, D // H)
    # Row 0: a 100-code prompt, then a 20-key window just behind queries at `at`; row 1: a 120-key window only.
    qpos = torch.stack([at + torch.arange(T), at // 2 + torch.arange(T)])
    ppos = torch.stack([torch.cat([torch.arange(100), at - 20 + torch.arange(20)]),
                        at // 2 - 120 + torch.arange(120)]).clamp(min=0)
    kpos = torch.cat([ppos, qpos], 1)
    z = torch.zeros(2, 120, H, D // H)
    got = attn.relative(q, AttnContext.build(qpos, KV(z, z, ppos, torch.ones(2, 120, dtype=torch.bool)), D,
                                             torch.float32))
    want = _table_gather_relative(attn, q, qpos, kpos)
    exact = _exact_relative(attn, q, qpos, kpos)
    assert got.shape == want.shape == (2, H, T, 140)
    scale = float(exact.abs().max())
    assert scale > 1.0
    # float32 angles pos * w are rounded by up to half an ulp of the position (2.4e-4 rad at 5000) in both forms (the
    # table rounds distance angles, the factors round query and key angles): measured |error| / scale is 5e-7 at 30,
    # 9e-6 at 1000, 5e-5 at 5000 for either form against float64, and the same between the two.
    tol = 2e-8 * max(at, 100) * scale
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=tol)
    torch.testing.assert_close(want.double(), exact, rtol=0, atol=tol)


def _args_at(dec: CodecDecoder, voice, done: int, codes_seed: int):
    """encode()'s inputs for the next full chunk of a fresh stream that has decoded `done` codes."""
    s = dec.open_stream("e", voice=voice, seed=0)
    s.push(_codes(done + dec.cfg.flow.pre_lookahead, seed=codes_seed))
    assert s.flow_state.codes_done == done
    return s.flow_state


@torch.inference_mode()
def test_prefix_padded_to_alignment_gives_the_unpadded_encoding(window_dec):
    from engines.speech_out.flow.state import PREFIX_ALIGN, padded_prefix

    flow, r = window_dec.flow, window_dec.cfg.flow.token_mel_ratio
    state = _args_at(window_dec, Voice.random(seed=3, n_codes=11), 10, 40)
    L, U = 11 + 10, (11 + 10) * r  # prompt + window keys of each stack
    codes = torch.as_tensor(_codes(8, seed=4))[None]
    args = list(flow.encode_inputs([state], codes, 5, [3]))
    X, kpos, kvalid, upX, up_kpos, up_kvalid = args[6:]
    assert X.shape[3] == padded_prefix(L) > L and upX.shape[3] == padded_prefix(U) > U
    assert X.shape[3] % PREFIX_ALIGN == 0 and upX.shape[3] % PREFIX_ALIGN == 0
    assert kvalid[:, :L].all() and not kvalid[:, L:].any() and up_kvalid[:, :U].all() and not up_kvalid[:, U:].any()
    trimmed = args[:6] + [X[:, :, :, :L], kpos[:, :L], kvalid[:, :L], upX[:, :, :, :U], up_kpos[:, :U],
                          up_kvalid[:, :U]]
    # Garbage in the padded keys and their positions must not matter: they are masked.
    g = torch.Generator().manual_seed(0)
    X, upX, kpos, up_kpos = X.clone(), upX.clone(), kpos.clone(), up_kpos.clone()
    X[:, :, :, L:] = 100 * torch.randn(X[:, :, :, L:].shape, generator=g)
    upX[:, :, :, U:] = 100 * torch.randn(upX[:, :, :, U:].shape, generator=g)
    kpos[:, L:], up_kpos[:, U:] = 777, -5
    padded = args[:6] + [X, kpos, kvalid, upX, up_kpos, up_kvalid]
    want, got = flow.encode(*trimmed), flow.encode(*padded)
    assert want[0].shape == (1, 80, 5 * r) and float(want[0].abs().max()) > 1e-2
    for a, b in zip(got, want, strict=True):
        # Same keys, only masked ones added: float32 softmax/matmul over a longer row, rounding only.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_encode_real_rows_unchanged_by_rows_repeated_as_batch_padding(window_dec):
    flow = window_dec.flow
    states = [_args_at(window_dec, None, 15, 50), _args_at(window_dec, Voice.random(seed=5, n_codes=3), 5, 51),
              _args_at(window_dec, Voice.random(seed=6, n_codes=40), 0, 52)]
    codes = torch.as_tensor(np.stack([_codes(8, seed=60 + i) for i in range(3)]))
    args = flow.encode_inputs(states, codes, 5, [3, 1, 0])
    want = flow.encode(*args)
    # As BucketGraphs.run pads a batch of 3 to the bucket of 4 (here 3 more rows to also repeat several times).
    got = flow.encode(*[torch.cat([t, t[-1:].expand(3, *t.shape[1:])]) for t in args])
    for a, b in zip(got, want, strict=True):
        assert a.shape[0] == 6 and b.shape[0] == 3
        torch.testing.assert_close(a[:3], b, rtol=0, atol=BATCH_TOL)
        torch.testing.assert_close(a[3:], b[2:].expand_as(a[3:]), rtol=0, atol=BATCH_TOL)


def test_precaptured_prefix_lengths_cover_every_full_chunk(window_dec, monkeypatch):
    """EncoderGraphs.prefix_lengths(P) lists every (codes, frames) prefix length a full chunk of a voice with P
    prompt codes reaches, so the pre-captured graphs serve a whole answer (CUDA itself is tested in tests/gpu)."""
    from engines.speech_out.chunk_graphs import EncoderGraphs

    flow = window_dec.flow
    seen = []
    real = flow.encode

    def spy(*args):
        if args[0].shape[1] == 5 + flow.cfg.pre_lookahead:
            seen.append((args[6].shape[3], args[9].shape[3]))
        return real(*args)

    monkeypatch.setattr(flow, "encode", spy)
    for voice in (None, Voice.empty(), Voice.random(seed=8, n_codes=30)):
        seen.clear()
        P = window_dec.prepared(voice or window_dec.default_voice).n_codes
        window_dec.stream_all(_codes(47, seed=70), voice=voice)
        lengths = EncoderGraphs(flow).prefix_lengths(P)
        assert len(seen) == 9 and set(seen) == set(lengths)
    # The tiny preset's default voice: 25 prompt codes + windows of 0, 5, .. 20 codes = 25..45 keys (-> 32, 32, 64,
    # 64, 64), 4 frames per code = 100..180 keys (-> 128, 128, 160, 160, 192).
    assert EncoderGraphs(flow).prefix_lengths(25) == [(32, 128), (64, 160), (64, 192)]


def test_bucket_graphs_pad_to_the_smallest_captured_batch_up_to_the_power_of_two(monkeypatch):
    """A call replays the smallest captured batch that holds it (FINE_BUCKETS' 6 for 5 rows), never more than its
    power-of-two bucket (captured on first use, as before); outputs are its own rows; the counts say what ran."""
    graphs_mod = replay_stand_in(monkeypatch)
    assert graphs_mod.buckets_up_to(3, graphs_mod.FINE_BUCKETS) == [3, 2, 1]  # largest first: the capture order
    assert graphs_mod.buckets_up_to(33, graphs_mod.FINE_BUCKETS)[:3] == [40, 32, 28]
    assert graphs_mod.buckets_up_to(33) == [64, 32, 16, 8, 4, 2, 1]
    g = graphs_mod.BucketGraphs(lambda x, k: (x * k + 1,))
    for b in graphs_mod.buckets_up_to(12, graphs_mod.FINE_BUCKETS):
        g.ensure([torch.zeros(b, 3)], (2,))
    x = torch.arange(15.0).view(5, 3)
    (y,) = g.run([x], (2,))
    assert torch.equal(y, x * 2 + 1)
    assert g.last_batch == 6  # 5 rows ran as 6
    assert g.padded(12, [x], (2,)) == 12 and g.padded(9, [x], (2,)) == 12
    # Other static arguments or shapes: nothing captured for them, so the power of two (as before), captured now.
    assert g.padded(5, [x], (3,)) == 8
    n = len(g.graphs)
    (y,) = g.run([x], (3,))
    assert torch.equal(y, x * 3 + 1) and len(g.graphs) == n + 1 and (8, (3,), 3) in g.graphs
    g.ensure([torch.zeros(16, 3)], (4,))
    assert g.padded(3, [x], (4,)) == 4  # 16 is captured, but 3 rows are not padded past their bucket
    # An owner that captures no more (EncoderGraphs once frozen) runs a shape it lacks eagerly; captured ones replay.
    g.may_capture = lambda: False
    n, last = len(g.graphs), g.last_batch
    (y,) = g.run([x], (5,))
    assert torch.equal(y, x * 5 + 1) and len(g.graphs) == n and g.last_batch == last
    (y,) = g.run([x], (2,))
    assert torch.equal(y, x * 2 + 1) and g.last_batch == 6


def test_run_jobs_counts_its_solves(window_dec):
    """CodecDecoder.counts: one solve per chunk length in a call, the partial ones, and rows as run (no graphs on CPU:
    as many as sessions); take_counts hands them over and starts again."""
    dec = window_dec
    chunk, la = dec.cfg.stream.chunk_codes, dec.cfg.flow.pre_lookahead
    dec.take_counts()
    a, b, c = (dec.open_stream(n, seed=i) for i, n in enumerate("abc"))
    a.add(_codes(chunk + la, seed=1))
    b.add(_codes(chunk + la, seed=2))
    c.add(_codes(2, seed=3))
    dec.run_jobs(a.take_jobs() + b.take_jobs() + c.take_jobs(finishing=True))
    got = dec.take_counts()
    assert (got.solves, got.partial, got.rows, got.padded_rows) == (2, 1, 3, 3)
    assert dec.take_counts().solves == 0


def _decode_sessions(dec: CodecDecoder, lengths: list[int]) -> dict[str, np.ndarray]:
    """Sessions s0, s1, ... of `lengths` codes (seeds 80 + i), all given at once and finished, then decoded in
    rounds (in_rounds): each session's PCM."""
    streams = [dec.open_stream(f"s{i}", seed=i) for i in range(len(lengths))]
    for i, (s, n) in enumerate(zip(streams, lengths, strict=True)):
        s.add(_codes(n, seed=80 + i))
    return {f"s{i}": pcm for i, pcm in enumerate(in_rounds(dec, streams)[0])}


def test_encoder_graphs_bookkeeping_with_areplay_stand_in(window_dec, monkeypatch):
    """EncoderGraphs on CPU, its capture replaced by a stand-in that re-runs FlowModel.encode on the static inputs at
    every replay: the pre-captured keys are the ones decoding uses (no capture while decoding), full chunks go
    through the graphs (batch padded to the bucket, outputs sliced back) and the result equals eager decoding."""
    graphs_mod = replay_stand_in(monkeypatch)
    dec = CodecDecoder.load("tiny-random", vocoder="hift", context="window")
    dec.flow.enc_graphs = graphs_mod.EncoderGraphs(dec.flow)
    assert dec.capture_graphs(3) == 3 * 3  # buckets 1, 2, 4 x 3 prefix lengths (no Euler / vocoder graphs on CPU)
    keys = set(dec.flow.enc_graphs.graphs)
    lengths = [13, 21, 9]
    got = _decode_sessions(dec, lengths)
    assert set(dec.flow.enc_graphs.graphs) == keys
    replays = {k[0]: g.replays for k, (g, _, _) in dec.flow.enc_graphs.graphs.items() if g.replays}
    assert replays.get(4), replays  # the first chunks of all three sessions: batch 3 padded to 4
    for i, n in enumerate(lengths):
        want = window_dec.stream_all(_codes(n, seed=80 + i), seed=i)
        np.testing.assert_allclose(got[f"s{i}"], want, atol=BATCH_TOL, rtol=0)
    # Once pre-captured, another voice's prefix lengths run eagerly instead of capturing in the middle of an answer.
    voice = Voice.random(seed=8, n_codes=30)
    other = dec.stream_all(_codes(17, seed=90), voice=voice, seed=4)
    assert set(dec.flow.enc_graphs.graphs) == keys
    want = window_dec.stream_all(_codes(17, seed=90), voice=voice, seed=4)
    np.testing.assert_allclose(other, want, atol=BATCH_TOL, rtol=0)


def test_encoder_graph_inputs_written_in_place(monkeypatch):
    """A full chunk whose encoder graph is captured writes its inputs straight into the graph's buffers and its index
    inputs' host mirror (EncoderGraphs.buffers, then replay_staged: no per-input copy through EncoderGraphs.run), and
    what those held before changes nothing: with every buffer and host array filled with large values before it is
    written (the prefix keys past each session's own are masked; rows past the batch are not read) the PCM is the
    same, bit for bit."""
    graphs_mod = replay_stand_in(monkeypatch)
    lengths = [13, 21, 9]

    def decode_all(poison: bool) -> tuple[dict[str, np.ndarray], int, int]:
        dec = CodecDecoder.load("tiny-random", vocoder="hift", context="window")
        graphs = dec.flow.enc_graphs = graphs_mod.EncoderGraphs(dec.flow)
        dec.capture_graphs(3)
        calls = {"run": 0, "in_place": 0}
        run, buffers = graphs.run, graphs.buffers

        def counted_run(*a):
            calls["run"] += 1
            return run(*a)

        def poisoned_buffers(*a):
            got = buffers(*a)
            if got is not None:
                calls["in_place"] += 1
                if poison:
                    for t in got[1]:
                        t.fill_(1e3 if t.is_floating_point() else 3)
                    for a in got[2]:
                        a.fill(3)
            return got

        monkeypatch.setattr(graphs, "run", counted_run)
        monkeypatch.setattr(graphs, "buffers", poisoned_buffers)
        return _decode_sessions(dec, lengths), calls["run"], calls["in_place"]

    clean, runs, in_place = decode_all(poison=False)
    poisoned, _, _ = decode_all(poison=True)
    assert runs == 0 and in_place >= 2, (runs, in_place)  # batches 3 (padded to 4), 2 and 1: all captured
    for k in clean:
        np.testing.assert_array_equal(poisoned[k], clean[k])
