"""Triton fusions of the codec estimator (engines/kernels/speech_out/flow/) against the torch path they replace.
Run on a GPU machine: `pytest tests/gpu/test_codec_kernels.py`. On CPU-only CI the whole module is skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (Triton kernels); the CPU path is tests/engines/speech_out/test_decoder.py",
                allow_module_level=True)
pytest.importorskip("triton", reason="the codec kernels are Triton kernels")

from engines.kernels.speech_out.flow.attention import (  # noqa: E402
    QKV_ATTENTION_ROWS,
    ln_qkv_attention,
    ln_qkv_attention_fits,
    window_attention,
)
from engines.kernels.speech_out.flow.conv import causal_conv  # noqa: E402
from engines.kernels.speech_out.flow.gemm import linear, ln_linear  # noqa: E402
from engines.kernels.speech_out.flow.norms import NORM_ONE_ROW_MAX, add_layernorm, layernorm_mish  # noqa: E402
from engines.speech_out.flow.estimator import TransformerBlock, conv_weight_gemm, window_mask  # noqa: E402

# float32: same math, different reduction order. bf16: both paths round at the same points, so at most a one-ulp
# flip (2^-8 relative) where a float32 intermediate lands next to a rounding boundary.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
# (B, T) of the LayerNorm tests: a row a program, then NORM_ROWS a program (just past NORM_ONE_ROW_MAX, T not a
# multiple of them)
NORM_SIZES = [(3, 40), (NORM_ONE_ROW_MAX // 37 + 1, 37)]


def _norm_params(c: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (1 + 0.1 * torch.randn(c, device="cuda", generator=g)).to(dtype)
    b = (0.1 * torch.randn(c, device="cuda", generator=g)).to(dtype)
    return w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_row,with_res", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("B,T", NORM_SIZES)
def test_layernorm_mish_matches_torch(dtype, with_row, with_res, B, T):
    C = 256
    g = torch.Generator(device="cuda").manual_seed(0)
    # A strided input, as the causal conv's sliced output is: [B, C, T + 2][..., :T].
    x = (3 * torch.randn(B, C, T + 2, device="cuda", generator=g)).to(dtype)[..., :T]
    w, b = _norm_params(C, dtype)
    row = torch.randn(1, C, device="cuda", generator=g).to(dtype) if with_row else None
    res = torch.randn(B, C, T, device="cuda", generator=g).to(dtype).transpose(1, 2).contiguous().transpose(1, 2) \
        if with_res else None  # a non-contiguous residual too
    want = F.mish(F.layer_norm(x.transpose(1, 2), (C,), w, b, 1e-5).transpose(1, 2))
    if row is not None:
        want = want + row[:, :, None]
    if res is not None:
        want = want + res
    got = layernorm_mish(x, w, b, 1e-5, row, res)
    assert got.shape == (B, C, T) and got.dtype == dtype and got.transpose(1, 2).is_contiguous()  # time-major
    torch.testing.assert_close(got, want, **TOL[dtype])


# Products of bf16 inputs are exact in float32 and both paths accumulate in float32 (in different orders), then
# round once: the bf16 bound is one output ulp (2^-8 relative) plus the accumulation-order difference.
CONV_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cin,cout,k,batch,T", [(320, 256, 3, 2, 40), (256, 256, 3, 32, 40), (512, 256, 3, 3, 37),
                                                 (256, 256, 3, 4, 40), (256, 256, 1, 2, 40), (256, 80, 1, 33, 24),
                                                 (100, 70, 5, 1, 9), (320, 512, 3, 17, 40), (100, 70, 5, 9, 80)])
@pytest.mark.parametrize("layout", ["time_major", "contiguous"])
def test_causal_conv_matches_torch(dtype, cin, cout, k, batch, T, layout):
    """Every tile edge: M not a multiple of the row tile, Cout < the column tile, Cin not a multiple of 64; each
    kernel and loop (whole-tile up to CONV_WHOLE_MAX_ROWS = 160 rows, 2 x 40 and 4 x 40 here; the looped one above,
    its flat loop from CONV_FLAT_MIN_ROWS = 640 rows for 2-byte inputs with Cin a multiple of 64: 17 x 40 and
    32 x 40 here, not 9 x 80)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(batch, cin, T, device="cuda", generator=g).to(dtype)
    if layout == "time_major":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    w = (torch.randn(cout, cin, k, device="cuda", generator=g) / (cin * k) ** 0.5).to(dtype)
    b = torch.randn(cout, device="cuda", generator=g).to(dtype)
    want = F.conv1d(F.pad(x.double(), (k - 1, 0)), w.double(), b.double()).to(dtype)  # float64: no TF32
    got = causal_conv(x, conv_weight_gemm(w), b, k)
    assert got.shape == (batch, cout, T) and got.dtype == dtype and got.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(got, want, **CONV_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res,bias,gelu", [(False, False, False), (True, True, True), (True, False, False)])
@pytest.mark.parametrize("rows", [80, 400, 1280, 37])  # 1280: the unfused path
def test_ln_linear_matches_torch(dtype, with_res, bias, gelu, rows):
    """add + LayerNorm + Linear (+ bias, + exact GELU) against add_layernorm then F.linear / F.gelu."""
    C, N = 256, 1536 if not gelu else 1024
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(1, rows, C, device="cuda", generator=g).to(dtype)
    r = torch.randn(1, rows, C, device="cuda", generator=g).to(dtype) if with_res else None
    w, b = _norm_params(C, dtype)
    lin = (torch.randn(N, C, device="cuda", generator=g) / C ** 0.5).to(dtype)
    lb = torch.randn(N, device="cuda", generator=g).to(dtype) if bias else None
    h_want, s_want = add_layernorm(x, r, w, b, 1e-5)
    want = F.linear(h_want.double(), lin.double(), lb.double() if lb is not None else None).to(dtype)
    if gelu:
        want = F.gelu(want.float()).to(dtype)
    got, s = ln_linear(x, r, w, b, 1e-5, lin.t().contiguous(), lb, gelu=gelu)
    torch.testing.assert_close(s, s_want, rtol=0, atol=0)  # the same rounded add
    torch.testing.assert_close(got, want, **CONV_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,N", [(512, 256), (1024, 256), (64, 48)])
@pytest.mark.parametrize("rows,bias", [(80, True), (37, False), (160, True), (400, True)])  # 400: F.linear
@pytest.mark.parametrize("with_res", [False, True])
def test_linear_matches_torch(dtype, K, N, rows, bias, with_res):
    """The whole-K-tile linear (to_out, ff output; + the residual stream for a stack's last block) against a
    float64 F.linear rounded, then the rounded add; 3-D input as the estimator passes it."""
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(2, rows, K, device="cuda", generator=g).to(dtype)[:1]
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype) if bias else None
    r = torch.randn(1, rows, N, device="cuda", generator=g).to(dtype) if with_res else None
    want = F.linear(x.double(), w.double(), b.double() if b is not None else None).to(dtype)
    got = linear(x, w, b, residual=r)
    assert got.shape == (1, rows, N) and got.dtype == dtype
    if r is None:
        torch.testing.assert_close(got, want, **CONV_TOL[dtype])
    else:  # one GEMM-output ulp may flip, and the add rounds once more
        torch.testing.assert_close(got, want + r, rtol=CONV_TOL[dtype]["rtol"], atol=2 * CONV_TOL[dtype]["atol"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,ctx", [(40, 20), (24, 20), (128, 60), (5, 0)])
def test_window_attention_matches_sdpa(dtype, T, ctx):
    B, H, D = 3, 8, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(B, T, 3 * H * D, device="cuda", generator=g).to(dtype)
    mask = window_mask(T, ctx, torch.device("cuda"), dtype)  # rows padded in storage, as the estimator passes it
    q, k, v = qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).double().unbind(0)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.double()).transpose(1, 2).reshape(B, T, H * D)
    got = window_attention(qkv, mask, H, D)
    torch.testing.assert_close(got, want.to(dtype), **CONV_TOL[dtype])


def test_window_attention_refuses_long_windows_and_bad_shapes():
    qkv = torch.zeros(1, 129, 3 * 2 * 16, device="cuda")
    with pytest.raises(ValueError, match="exceeds"):
        window_attention(qkv, torch.zeros(129, 129, device="cuda"), 2, 16)
    with pytest.raises(ValueError, match="is not"):
        window_attention(qkv[:, :8], torch.zeros(8, 8, device="cuda"), 4, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B", sorted({2, *QKV_ATTENTION_ROWS}))  # 2: a chain's call
@pytest.mark.parametrize("T,ctx,with_res,batched_mask",
                         [(40, 20, True, False), (37, 20, False, True), (5, 0, True, True)])
def test_ln_qkv_attention_is_bit_identical_to_ln_linear_then_window_attention(dtype, B, T, ctx, with_res, batched_mask):
    """The fused q/k/v GEMM + window attention == the two kernels it replaces, bit for bit (output and residual
    stream), at a chain's two rows and the ends of its band, padded windows, 2-D and per-row masks."""
    C, H, D = 256, 8, 64
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(B, T, C, device="cuda", generator=g).to(dtype)
    r = torch.randn(B, T, C, device="cuda", generator=g).to(dtype) if with_res else None
    w, b = _norm_params(C, dtype)
    wt = (torch.randn(C, 3 * H * D, device="cuda", generator=g) / C ** 0.5).to(dtype)
    mask = window_mask(T, ctx, torch.device("cuda"), dtype)
    if batched_mask:
        mask = mask.expand(B, T, T).clone()
    qkv, s_want = ln_linear(x, r, w, b, 1e-5, wt)
    want = window_attention(qkv, mask, H, D)
    got, s = ln_qkv_attention(x, r, w, b, 1e-5, wt, mask, H, D)
    assert torch.equal(s, s_want) and torch.equal(got, want)
    assert got.abs().max() > 0


def test_ln_qkv_attention_refuses_what_it_does_not_take():
    C, H, D = 256, 8, 64
    lo, hi = QKV_ATTENTION_ROWS
    w, b = _norm_params(C, torch.bfloat16)
    wt = torch.zeros(C, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(40, 40, device="cuda", dtype=torch.bfloat16)
    for x in (torch.zeros(hi + 1, 40, C, device="cuda", dtype=torch.bfloat16),  # past ln_linear's 640 rows
              torch.zeros(lo, 40, C, device="cuda"),  # float32: three weight tiles past shared memory
              torch.zeros(lo, 65, C, device="cuda", dtype=torch.bfloat16)):  # window too long
        assert not ln_qkv_attention_fits(x, D)
        with pytest.raises(ValueError, match="does not take"):
            ln_qkv_attention(x, None, w, b, 1e-5, wt, mask, H, D)
    x = torch.zeros(lo, 40, C, device="cuda", dtype=torch.bfloat16)
    # The band counts the windows of every call side by side (a solve's chains), not one call's rows.
    assert ln_qkv_attention_fits(x, D) and not ln_qkv_attention_fits(x[:2], D)
    assert ln_qkv_attention_fits(x[:2], D, windows=lo) and not ln_qkv_attention_fits(x[:2], D, windows=hi + 1)
    with pytest.raises(ValueError, match="q/k/v weight"):
        ln_qkv_attention(x, None, w, b, 1e-5, wt[:, :-1], mask, H, D)
    with pytest.raises(ValueError, match="mask"):
        ln_qkv_attention(x, None, w, b, 1e-5, wt, mask[:39, :39], H, D)


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

    dec = CodecDecoder.load("full-random", device="cuda", vocoder="hift", estimator_dtype="bfloat16")
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


def test_causal_conv_refuses_a_mismatched_weight():
    x = torch.zeros(1, 8, 4, device="cuda")
    with pytest.raises(ValueError, match="does not fit"):
        causal_conv(x, torch.zeros(3 * 16, 8, device="cuda"), torch.zeros(8, device="cuda"), 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("B,T", NORM_SIZES)
def test_add_layernorm_matches_torch(dtype, with_res, B, T):
    C = 256
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(B, C, T, device="cuda", generator=g).to(dtype).transpose(1, 2)  # [B, T, C] view, as in _attend
    r = torch.randn(B, T, C, device="cuda", generator=g).to(dtype) if with_res else None
    w, b = _norm_params(C, dtype)
    s_want = x + r if r is not None else x
    y_want = F.layer_norm(s_want, (C,), w, b, 1e-5)
    y, s = add_layernorm(x, r, w, b, 1e-5)
    torch.testing.assert_close(s, s_want, rtol=0, atol=0)  # one rounded add: exact
    torch.testing.assert_close(y, y_want, **TOL[dtype])


def test_estimator_cuda_path_matches_cpu_reference():
    """The whole estimator (fused kernels + fused q/k/v + table) on CUDA vs on CPU, float32, tiny-random."""
    from engines.speech_out import CodecDecoder

    cpu = CodecDecoder.load("tiny-random", vocoder="hift")
    gpu = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift")
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

    dec = CodecDecoder.load("tiny-random", device="cuda", vocoder="hift", estimator_dtype="bfloat16")
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

    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", estimator_dtype="bfloat16")
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


def test_snake_is_bit_identical_to_torch():
    """HiFT's Snake in one kernel gives torch's bits (IEEE division, libdevice sinf, no FMA), over alphas from tiny
    to large and inputs spanning many periods; other dtypes and shapes are refused."""
    from engines.kernels.speech_out.snake import snake
    from engines.speech_out.vocoder.hift import Snake

    g = torch.Generator(device="cuda").manual_seed(7)
    B, C, T = 3, 64, 1001  # T not a multiple of the kernel's block: the tail is masked
    x = torch.randn(B, C, T, device="cuda", generator=g) * torch.logspace(-2, 2, T, device="cuda")
    alpha = torch.logspace(-6, 1, C, device="cuda")
    a = alpha[None, :, None]
    want = x + (1.0 / (a + 1e-9)) * torch.sin(a * x).pow(2)
    assert torch.equal(snake(x, alpha), want)
    tm = x.transpose(1, 2).contiguous().transpose(1, 2)  # time-major memory (HiFT's layout on CUDA)
    got = snake(tm, alpha)
    assert torch.equal(got, want) and got.stride() == tm.stride()  # the output keeps the layout
    assert torch.equal(snake(x[:, :, ::2], alpha), want[:, :, ::2])  # other strides: made contiguous first
    module = Snake(C).cuda()
    with torch.no_grad():
        module.alpha.copy_(alpha)
        assert torch.equal(module(x), want)
    with pytest.raises(ValueError, match="float32"):
        snake(x.bfloat16(), alpha)
    with pytest.raises(ValueError, match="alpha"):
        snake(x, alpha[:10])


def test_snake_with_bias_and_residual_is_bit_identical_to_torch():
    """The bias and residual adds taken into the Snake pass give torch's bits: snake(x, alpha, bias) ==
    Snake(x + bias), add_snake(x, bias, r, alpha) == (r + (x + bias), Snake(that)); wrong shapes are refused."""
    from engines.kernels.speech_out.snake import add_snake, snake

    g = torch.Generator(device="cuda").manual_seed(8)
    B, C, T = 2, 48, 777
    x = torch.randn(B, C, T, device="cuda", generator=g) * 3
    r = torch.randn(B, C, T, device="cuda", generator=g)
    bias = torch.randn(C, device="cuda", generator=g)
    alpha = torch.logspace(-3, 1, C, device="cuda")
    a = alpha[None, :, None]

    def ref(v):
        return v + (1.0 / (a + 1e-9)) * torch.sin(a * v).pow(2)

    biased = x + bias[None, :, None]
    assert torch.equal(snake(x, alpha, bias), ref(biased))
    s, y = add_snake(x, bias, r, alpha)
    assert torch.equal(s, r + biased) and torch.equal(y, ref(r + biased))
    s, y = add_snake(x, None, r, None)
    assert torch.equal(s, r + x) and y is None
    # time-major x (HiFT's layout on CUDA) with a residual in either layout: the same bits, x's layout out
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    for rr in (r, r.transpose(1, 2).contiguous().transpose(1, 2)):
        s, y = add_snake(xt, bias, rr, alpha)
        assert torch.equal(s, r + biased) and torch.equal(y, ref(r + biased))
        assert s.stride() == y.stride() == xt.stride()
    with pytest.raises(ValueError, match="bias"):
        snake(x, alpha, bias[:3])
    with pytest.raises(ValueError, match="residual"):
        add_snake(x, bias, r[:, :, :5], alpha)


@pytest.mark.parametrize("transposed,k,stride,dilation", [(False, 7, 1, 1), (False, 11, 1, 5), (False, 16, 8, 1),
                                                          (True, 16, 8, 1), (True, 7, 3, 1)])
def test_hift_conv_time_major_matches_the_1d_conv(transposed, k, stride, dilation, deterministic_cudnn):
    """hift.conv on CUDA (a channels-last 2-D conv) gives the 1-D conv's output to TF32 rounding, in time-major memory,
    from time-major or contiguous input, at one row or two; without its bias when asked."""
    from engines.speech_out.vocoder import hift

    torch.manual_seed(3)
    cin, cout = 64, 48
    m = (torch.nn.ConvTranspose1d(cin, cout, k, stride, padding=(k - stride) // 2) if transposed else
         torch.nn.Conv1d(cin, cout, k, stride, padding=(k * dilation - dilation) // 2, dilation=dilation)).cuda()
    x = torch.randn(2, cin, 300, device="cuda")
    with torch.inference_mode():
        want = m(x)
        for inp in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
            got = hift.conv(m, inp)
            assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()
            torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
        no_bias = hift.conv(m, x, bias=False)
        torch.testing.assert_close(no_bias + m.bias[None, :, None], hift.conv(m, x), rtol=0, atol=1e-5)
        one = hift.conv(m, x[:1])
        assert one.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(one, want[:1], rtol=0, atol=2e-3 * float(want.abs().max()))


def test_hift_time_major_matches_the_1d_layout(deterministic_cudnn):
    """The full-size HiFT generator with its activations time-major (on CUDA) gives the 1-D layout's body output
    (before conv_post) and waveform (the CPU's, every conv in float32 on both sides) through its ~90 convs, at 2
    sessions. f0 is held at 0 (unvoiced: the source is the noise alone), since a rounding-sized change of f0 moves the
    harmonic phases a lot over a window; a layout error (a channel read from the wrong place) would be of the
    signal's own size."""
    import copy

    from engines.speech_out.config import HiFTConfig
    from engines.speech_out.vocoder import hift

    torch.manual_seed(0)
    gen = hift.HiFTGenerator(HiFTConfig()).eval()
    gen.fold_weight_norm()
    with torch.no_grad():
        for m in gen.modules():  # small weights keep the 3-stage stack finite
            if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                m.weight.mul_(0.3)
        gen.f0_predictor.classifier.weight.zero_()
        gen.f0_predictor.classifier.bias.zero_()
    cpu, gen = gen, copy.deepcopy(gen).cuda()
    g = torch.Generator().manual_seed(1)
    T = 32
    mel = torch.randn(2, 80, T, generator=g) - 5
    phase = torch.rand(2, gen.n_harmonics, generator=g)
    noise = torch.randn(2, gen.n_harmonics, T * gen.cfg.mel.hop, generator=g)
    keep = 20 * gen.cfg.mel.hop
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convs in full float32, like the CPU
    try:
        with torch.inference_mode():
            body, got_phase = gen._branched(mel.cuda(), phase.cuda(), noise.cuda(), keep)
            assert body.transpose(1, 2).is_contiguous()  # time-major to the end
            got, _ = gen(mel.cuda(), phase.cuda(), noise.cuda(), keep)
            want_body, want_phase = cpu._serial(mel, phase, noise, keep)
            assert want_body.is_contiguous()
            want, _ = cpu(mel, phase, noise, keep)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert want_body.abs().max() > 1e-2 and want.abs().max() > 1e-3
    torch.testing.assert_close(body.cpu(), want_body, rtol=0, atol=1e-2 * float(want_body.abs().max()))
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=5e-2 * float(want.abs().max()))
    assert torch.equal(got_phase.cpu(), want_phase)


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_resblock_is_bit_identical_to_the_reference(batch, deterministic_cudnn):
    """HiFT's resblock with its conv biases and residual adds inside the Snake kernels (the CUDA path) gives the
    reference order's bits (every conv through cuDNN with its bias added by torch, then Snake, then the add)."""
    from torch.nn.utils import parametrize

    from engines.speech_out.vocoder.hift import ResBlock

    torch.manual_seed(0)
    block = ResBlock(64, 7, (1, 3, 5)).cuda().eval()
    with torch.no_grad():
        for m in list(block.modules()):
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
        for act in (*block.activations1, *block.activations2):
            act.alpha.copy_(torch.rand(64) * 2 + 0.05)
        for conv in (*block.convs1, *block.convs2):
            conv.bias.normal_()
    x = torch.randn(batch, 64, 1001, device="cuda")
    with torch.inference_mode():
        want = block._forward_reference(x)
        got = block(x)
    assert want.abs().max() > 1
    assert torch.equal(got, want)


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic algorithms: some of the ones it picks otherwise accumulate with atomics, whose order
    changes when kernels share the GPU (HiFT's body: ~3e-8 from run to run at batch 1, ~4e-6 on streams at batch 3,
    H200), which would hide the bits a race between streams changes."""
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = before


@pytest.mark.parametrize("batch", [1, 3])
def test_hift_branches_on_streams_equal_the_serial_order(batch, deterministic_cudnn):
    """The full-size HiFT body with its source branch and each stage's resblocks on streams of their own gives the
    serial order's bits (before the iSTFT, whose F.fold adds with atomics), eager with the allocator's blocks moving
    between calls, and replayed from a CUDA graph."""
    from engines.lm.step_graphs import capture_graph, private_stream
    from engines.speech_out.config import HiFTConfig
    from engines.speech_out.vocoder.hift import HiFTGenerator

    torch.manual_seed(0)
    gen = HiFTGenerator(HiFTConfig()).cuda().eval()
    gen.fold_weight_norm()
    with torch.no_grad():
        for m in gen.modules():  # small weights keep the 3-stage stack finite
            if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                m.weight.mul_(0.3)
    g = torch.Generator(device="cuda").manual_seed(1)
    T = 32
    mel = torch.randn(batch, 80, T, device="cuda", generator=g) - 5
    phase = torch.rand(batch, gen.n_harmonics, device="cuda", generator=g)
    noise = torch.randn(batch, gen.n_harmonics, T * gen.cfg.mel.hop, device="cuda", generator=g)
    keep = 20 * gen.cfg.mel.hop
    with torch.inference_mode():
        want_x, want_phase = gen._serial(mel, phase, noise, keep)
        assert torch.isfinite(want_x).all() and want_x.abs().max() > 0
        for _ in range(5):
            churn = [torch.randn(1 << 20, device="cuda") for _ in range(4)]  # other blocks free next time
            got_x, got_phase = gen._branched(mel, phase, noise, keep)
            del churn
            assert torch.equal(got_x, want_x) and torch.equal(got_phase, want_phase)
        graph, (graph_x, graph_phase) = capture_graph(lambda: gen._branched(mel, phase, noise, keep),
                                                      private_stream("cuda"))
        for _ in range(3):
            graph_x.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(graph_x, want_x) and torch.equal(graph_phase, want_phase)


@pytest.mark.parametrize("codec", ["tiny-random", "full-random"])
def test_solve_in_pieces_is_bit_identical_to_one_graph(codec):
    """FlowModel.solve_parts: the served solve of playing answers as graphs of consecutive Euler steps (the codec
    worker pauses between them) == the solve as one graph, bit for bit, at 1 and 8 sessions."""
    from engines.speech_out import CodecDecoder
    from engines.speech_out.chunk_graphs import EulerGraphs

    dec = CodecDecoder.load(codec, device="cuda", vocoder="hift", estimator_dtype="bfloat16")
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


@pytest.mark.parametrize("cin,cout,k", [(320, 512, 3), (256, 256, 3), (256, 80, 1)])
@pytest.mark.parametrize("tiles", [(32, 128, 64, 4, 2), "served"])
def test_conv_flat_loop_is_bit_identical_to_the_loop_per_tap(cin, cout, k, tiles):
    """_causal_conv_kernel's FLAT loop (one loop over the flattened (tap, channel) reduction, served from
    CONV_FLAT_MIN_ROWS rows) takes the same K tiles in the same order as the loop per tap: bit-identical output at
    the same tiling, the served one and the per-tap loop's before it."""
    from dataclasses import replace

    from engines.kernels.speech_out.flow.conv import (
        CONV_FLAT_MIN_ROWS,
        CONV_FLAT_TILING,
        ConvTiling,
        launch_causal_conv,
    )

    g = torch.Generator(device="cuda").manual_seed(cin + k)
    nb, T = 64, 40  # 2,560 rows: a playing round's
    assert nb * T >= CONV_FLAT_MIN_ROWS
    x = torch.randn(nb, T, cin, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    w = (torch.randn(cout, cin, k, device="cuda", generator=g) / (k * cin) ** 0.5).to(torch.bfloat16)
    b = torch.randn(cout, device="cuda", generator=g).to(torch.bfloat16)
    wg = conv_weight_gemm(w)
    tiling = CONV_FLAT_TILING if tiles == "served" else ConvTiling(*tiles)
    outs = [launch_causal_conv(x, wg, b, k, replace(tiling, flat=flat)) for flat in (False, True)]
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    if tiles == "served":
        torch.testing.assert_close(causal_conv(x, wg, b, k), outs[1], rtol=0, atol=0)
    want = F.conv1d(x.float(), w.float(), b.float(), padding=k - 1)[..., :T]
    torch.testing.assert_close(outs[1].float(), want, **CONV_TOL[torch.bfloat16])
