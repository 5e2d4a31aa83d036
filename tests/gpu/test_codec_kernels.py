"""Triton fusions of the codec estimator (engines/kernels/codec_fused.py) against the torch path they replace.
Run on a GPU machine: `pytest tests/gpu/test_codec_kernels.py`. On CPU-only CI the whole module is skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (Triton kernels); the CPU path is tests/test_codec_decoder.py",
                allow_module_level=True)
pytest.importorskip("triton", reason="the codec kernels are Triton kernels")

from engines.kernels.codec_fused import add_layernorm, layernorm_mish  # noqa: E402

# float32: same math, different reduction order. bf16: both paths round at the same points, so at most a one-ulp
# flip (2^-8 relative) where a float32 intermediate lands next to a rounding boundary.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _norm_params(c: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (1 + 0.1 * torch.randn(c, device="cuda", generator=g)).to(dtype)
    b = (0.1 * torch.randn(c, device="cuda", generator=g)).to(dtype)
    return w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_row,with_res", [(False, False), (True, False), (False, True)])
def test_layernorm_mish_matches_torch(dtype, with_row, with_res):
    B, C, T = 3, 256, 40
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
    assert got.shape == (B, C, T) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_layernorm_matches_torch(dtype, with_res):
    B, T, C = 4, 40, 256
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
    from engines.codec.decoder import CodecDecoder

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
