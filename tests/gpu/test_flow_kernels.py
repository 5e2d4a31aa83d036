"""Triton kernels of the codec's flow estimator (engines/kernels/speech_out/flow/: LayerNorms, causal conv, GEMMs,
window attention and the fused LayerNorm+q/k/v+attention) against the torch path they replace.
Run on a GPU machine: `pytest tests/gpu/test_flow_kernels.py`. On CPU-only CI the whole module is skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (Triton kernels); the CPU path is tests/engines/speech_out/",
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
from engines.speech_out.flow.estimator import conv_weight_gemm, window_mask  # noqa: E402

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
