"""The codec's flow estimator and Euler solve on the GPU kernels: the fused q/k/v attention taken in its band with
the two-kernel path's bits, the CUDA path against the CPU reference, and the solve's graphs (PDL, chains,
pieces) against each other.
Run on a GPU machine: `pytest tests/gpu/test_flow_solve_kernels.py`. On CPU-only CI the whole module is skipped."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (Triton kernels); the CPU path is tests/engines/speech_out/",
                allow_module_level=True)
pytest.importorskip("triton", reason="the codec kernels are Triton kernels")

from engines.kernels.speech_out.flow.attention import QKV_ATTENTION_ROWS  # noqa: E402
from engines.speech_out.flow.estimator import TransformerBlock  # noqa: E402


def _fused_qkv_on_and_off(monkeypatch, run):
    """run() with ln_qkv_attention counted (the rows of each call), then again with it turned off by an empty band:
    (the rows of each fused call, the first result, the second)."""
    import engines.kernels.speech_out.flow.attention as cf

    calls = []
    fused = cf.ln_qkv_attention
    monkeypatch.setattr(cf, "ln_qkv_attention", lambda x, *a, **k: calls.append(x.shape[0]) or fused(x, *a, **k))
    with torch.inference_mode():
        got = run()
        n = len(calls)
        monkeypatch.setattr(cf, "QKV_ATTENTION_ROWS", (1, 0))
        want = run()
        torch.cuda.synchronize()
    assert len(calls) == n  # no fused call with the band off
    return calls, got, want


def _bf16_estimator():
    from engines.speech_out import CodecDecoder

    dec = CodecDecoder.load("full-random", device="cuda", vocoder="hift", estimator_dtype="bfloat16", context="window")
    est = dec.flow.decoder.estimator
    return dec.flow, est, sum(isinstance(m, TransformerBlock) for m in est.modules())


def test_estimator_takes_the_fused_qkv_attention_in_its_band_with_the_same_bits(monkeypatch):
    """A full-random estimator call (bf16) at a batch inside QKV_ATTENTION_ROWS runs ln_qkv_attention in every block
    and gives the bits of the two-kernel path (the fusion turned off by an empty band)."""
    _, est, blocks = _bf16_estimator()
    g = torch.Generator(device="cuda").manual_seed(0)
    B, W = QKV_ATTENTION_ROWS[0], 40
    x, mu, cond = (torch.randn(B, 80, W, device="cuda", generator=g).bfloat16() for _ in range(3))
    spks, t = torch.randn(B, 80, device="cuda", generator=g).bfloat16(), torch.rand(B, device="cuda", generator=g)
    mask = torch.ones(W, W, dtype=torch.bool, device="cuda").tril()
    calls, got, want = _fused_qkv_on_and_off(monkeypatch, lambda: est(x, mu, t, spks, cond, mask))
    assert calls == [B] * blocks and blocks > 0
    assert torch.equal(got, want)


def test_a_solve_in_chains_takes_the_fused_qkv_attention_by_its_windows(monkeypatch):
    """Four sessions' eight windows run as four chains of two (flow._estimate): each chain's blocks take
    ln_qkv_attention (the band counts all eight windows), with the bits of the two-kernel path."""
    from engines.speech_out.flow.estimator import bool_to_additive

    flow, est, blocks = _bf16_estimator()
    g = torch.Generator(device="cuda").manual_seed(1)
    n, W = 8, 40
    assert QKV_ATTENTION_ROWS[0] <= n <= QKV_ATTENTION_ROWS[1]
    h = torch.randn(n, 320, W, device="cuda", generator=g).bfloat16()
    rows = est.time_rows(torch.rand(1, device="cuda", generator=g))  # one Euler step: [n_resnets, 1, C]
    mask = bool_to_additive(torch.ones(W, W, dtype=torch.bool, device="cuda").tril(), torch.bfloat16)
    calls, got, want = _fused_qkv_on_and_off(monkeypatch, lambda: flow._estimate(est, h, rows, mask))
    assert calls == [2] * (4 * blocks)
    assert torch.equal(got, want)


def test_estimator_cuda_path_matches_cpu_reference():
    """The whole estimator (fused kernels + fused q/k/v + table) on CUDA vs on CPU, float32, tiny-random."""
    from engines.speech_out import CodecDecoder

    cpu = CodecDecoder.load("tiny-random", vocoder="hift", context="window")
    gpu = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", context="window")
    g = torch.Generator().manual_seed(0)
    B, W = 2, 40
    x, mu, cond = (torch.randn(B, 80, W, generator=g) for _ in range(3))
    spks, t = torch.randn(B, 80, generator=g), torch.rand(B, generator=g)
    mask = torch.ones(W, W, dtype=torch.bool).tril()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convs in full float32, like the CPU
    try:
        with torch.inference_mode():
            want = cpu.flow.decoder.estimator(x, mu, t, spks, cond, mask)
            got = gpu.flow.decoder.estimator(*(a.cuda() for a in (x, mu, t, spks, cond, mask))).cpu()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="programmatic dependent launch needs Hopper+")
def test_solve_graph_is_bit_identical_with_and_without_pdl():
    """The Euler solve's CUDA graph with every codec kernel under programmatic dependent launch (each waits for its
    predecessor before touching activations, weights read before the wait) == the same graph launched plainly."""
    from engines.kernels import pdl
    from engines.speech_out import CodecDecoder
    from engines.speech_out.chunk_graphs import EulerGraphs

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", estimator_dtype="bfloat16", context="window")
    flow, idx = dec.flow, torch.cuda.current_device()
    g = torch.Generator(device="cuda").manual_seed(7)
    inputs = [torch.randn(shape, device="cuda", dtype=flow.dtype, generator=g)
              for shape in EulerGraphs(flow).input_shapes(3)]
    out = {}
    try:
        for on in (False, True):
            pdl._enabled[idx] = on
            with torch.inference_mode():
                out[on] = EulerGraphs(flow).run(*inputs)
    finally:
        pdl._enabled.pop(idx, None)
    for a, b in zip(out[False], out[True], strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("codec", ["tiny-random", "full-random"])
def test_solve_in_chains_equals_each_session_alone(codec):
    """The served solve of 2 and 4 sessions runs the estimator's windows as chains side by side (flow.CHAIN_WINDOWS
    each): bit-identical to each session solved alone, and equal to one chain within what bf16 rounding grows to over
    the solve's 10 steps (one chain of 160 or 320 rows takes other tilings and, at 320, cuBLAS GEMMs; different kernel
    choices measured up to 1.9e-2 apart at full size)."""
    from engines.speech_out import CodecDecoder
    from engines.speech_out.chunk_graphs import EulerGraphs

    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", estimator_dtype="bfloat16", context="window")
    flow = dec.flow
    for batch in (2, 4):
        g = torch.Generator(device="cuda").manual_seed(batch)
        inputs = [torch.randn(shape, device="cuda", dtype=flow.dtype, generator=g)
                  for shape in EulerGraphs(flow).input_shapes(batch)]
        try:
            with torch.inference_mode():
                served = EulerGraphs(flow).run(*inputs)
                alone = [EulerGraphs(flow).run(*(t[b:b + 1] for t in inputs)) for b in range(batch)]
                flow.solve_chains = 1
                one = EulerGraphs(flow).run(*inputs)
        finally:
            flow.solve_chains = None
        for b in range(batch):
            for got, want in zip(served, alone[b], strict=True):
                torch.testing.assert_close(got[b:b + 1], want, rtol=0, atol=0)
        for got, want in zip(served, one, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("codec", ["tiny-random", "full-random"])
def test_solve_in_pieces_is_bit_identical_to_one_graph(codec):
    """FlowModel.solve_parts: the served solve of playing answers as graphs of consecutive Euler steps (the codec
    worker pauses between them) == the solve as one graph, bit for bit, at 1 and 8 sessions."""
    from engines.speech_out import CodecDecoder
    from engines.speech_out.chunk_graphs import EulerGraphs

    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", estimator_dtype="bfloat16", context="window")
    flow = dec.flow
    steps = flow.cfg.n_timesteps
    ranges = [(0, 2), (2, 5), (5, steps)] if steps > 5 else [(0, 1), (1, steps)]
    for batch in (1, 8):
        g = torch.Generator(device="cuda").manual_seed(batch)
        z, ctx, mu, cond, spks = (torch.randn(shape, device="cuda", dtype=flow.dtype, generator=g)
                                  for shape in EulerGraphs(flow).input_shapes(batch))
        graphs = EulerGraphs(flow)
        with torch.inference_mode():
            want_x, want_traj = graphs.run(z, ctx, mu, cond, spks)
            x, trajs = z, []
            for r in ranges:
                x, part = graphs.run(x, ctx, mu, cond, spks, steps=r)
                trajs.append(part)
        assert len(graphs.graphs) == 1 + len(ranges) and torch.isfinite(want_x).all()
        torch.testing.assert_close(x, want_x, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat(trajs, dim=1), want_traj, rtol=0, atol=0)
