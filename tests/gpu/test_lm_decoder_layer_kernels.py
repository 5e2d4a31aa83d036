"""Full-size decoder layers run by their kernels together: with and without programmatic dependent launch in a CUDA
graph, with the GLU epilogue or the separate SiLU*up kernel, over fp8 copies or their values.
Run: python3 -m pytest tests/gpu (needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.lm_kernel_cases import PRELOAD_LIMITS, full_size_layers, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")


@PRELOAD_LIMITS
def test_pdl_decoder_layers_in_a_graph_equal_without_pdl(preload):
    """Four full-size decoder layers (skinny GEMMs, fused norms, decode attention, all launched
    with programmatic dependent launch) captured in one CUDA graph give the same bits as the same graph without
    PDL, replay after replay with fresh inputs. The graph pool reuses buffers between layers, so a kernel that
    wrote before its predecessor finished reading (or read before it finished writing) would show up here."""
    from engines.kernels import pdl
    from engines.lm.step_graphs import capture_graph, private_stream

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper (sm_90) or later")
    layers, x, kv, cache, batch, forward = full_size_layers(rows=3)
    g = torch.Generator(device="cuda").manual_seed(12)
    dev = torch.cuda.current_device()
    saved = pdl._enabled.get(dev)
    outs = {}
    try:
        for on in (False, True):
            pdl._enabled[dev] = on
            graph, out = capture_graph(forward, private_stream())
            outs[on] = (graph, out)
    finally:
        if saved is None:
            pdl._enabled.pop(dev, None)
        else:
            pdl._enabled[dev] = saved
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16))
        results = {}
        for on, (graph, out) in outs.items():
            for c, c0 in zip(kv, [cache] * len(kv), strict=True):
                c.copy_(c0)  # the same cache before each graph (both write the new row's K/V)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            results[on] = (out.clone(), [c.clone() for c in kv])
        assert torch.isfinite(results[True][0]).all()
        assert torch.equal(results[True][0], results[False][0])
        for a, b in zip(results[True][1], results[False][1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_decoder_layers_with_the_glu_epilogue_equal_the_separate_kernels(rows, monkeypatch):
    """Four full-size layers at decode sizes with SiLU*up in gate_up's epilogue give the bits (outputs and K/V
    written) of the same layers with the separate SiLU*up kernel (what a layer runs where the epilogue cannot)."""
    from engines.kernels.lm import skinny_gemm

    layers, x, kv, cache, batch, forward = full_size_layers(rows)
    assert skinny_gemm.glu(x, layers[0].gate_up_proj.weight) is not None  # the epilogue runs in these layers
    outs = {}
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(skinny_gemm, "glu", lambda *a, **k: None)
        for c in kv:
            c.copy_(cache)
        outs[fuse] = (forward(), [c.clone() for c in kv])
    (fused, kv_fused), (plain, kv_plain) = outs[True], outs[False]
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    for a, b in zip(kv_fused, kv_plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [2, 24])
def test_decoder_layers_over_fp8_copies_match_the_same_layers_over_their_values(rows):
    """Four full-size layers with fp8 copies (the GLU epilogue included) against the same layers reading the bf16
    values of those copies, in a CUDA graph as the engine runs them: the same up to the GEMMs' summation order."""
    from engines.lm.model import fp8
    from engines.lm.step_graphs import capture_graph, private_stream

    layers, x, kv, cache, batch, forward = full_size_layers(rows)
    linears = [lin for layer in layers for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    for lin in linears:
        lin.fp8 = fp8.round_weight(lin.weight.data)
    outs = {}
    for on in (True, False):
        copies = [lin.fp8 for lin in linears]
        if not on:
            for lin in linears:
                lin.fp8 = None
        for c in kv:
            c.copy_(cache)
        forward()  # eager first: tunes the fp8 shapes outside the capture
        graph, out = capture_graph(forward, private_stream())
        for c in kv:
            c.copy_(cache)
        graph.replay()
        torch.cuda.synchronize()
        outs[on] = out.clone()
        for lin, cp in zip(linears, copies, strict=True):
            lin.fp8 = cp
    assert torch.isfinite(outs[True]).all()
    assert rel_err(outs[True], outs[False]) < 2e-2
