"""The speech encoder's float32 kernels on a CUDA device against the torch paths they replace: the attention
(engines/kernels/speech_in/attention.py) against SDPA over the gathered keys, at the shapes of a commit (one stream,
splits and their merge) and of held audio (many streams, one split), keys up to a whole segment; the 3xTF32 GEMM
(engines/kernels/speech_in/fp32_gemm.py) against float64, no less accurate than cuBLAS's SGEMM, a row's result
independent of
the rows beside it. The encoder's streaming tests (test_speech_encoder_gpu.py) run through both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _reference(q, keys, values, slots, qpos, t_max):
    batch, n_max = qpos.shape
    heads, d = q.shape[1], q.shape[2]
    mask = (torch.arange(t_max, device=q.device)[None, None, :] <= qpos[:, :, None])[:, None]
    qb = q.view(batch, n_max, heads, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(qb, keys[slots, :, :t_max], values[slots, :, :t_max], attn_mask=mask)
    return o.transpose(1, 2).reshape(batch * n_max, heads * d)


@pytest.mark.parametrize("batch,n_max,t_max,heads,d", [
    (1, 1, 16, 20, 64), (1, 4, 200, 20, 64), (1, 20, 1500, 20, 64), (3, 5, 97, 4, 16), (8, 32, 1024, 20, 64),
    (32, 16, 1000, 20, 64), (2, 40, 300, 4, 16),
])
def test_encoder_attention_equals_sdpa(batch, n_max, t_max, heads, d):
    from engines.kernels.speech_in.attention import encoder_attention

    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + t_max)
    n_slots, positions = batch + 3, max(t_max, 64) + 8
    keys = torch.randn(n_slots, heads, positions, d, device="cuda", generator=g)
    values = torch.randn(n_slots, heads, positions, d, device="cuda", generator=g)
    slots = torch.randperm(n_slots, device="cuda", generator=g)[:batch]
    # Each stream's queries are its last positions (some stream rows shorter: their tail is padding that still
    # looks at the stream's own keys), and never past t_max - 1.
    past = torch.randint(0, max(1, t_max - n_max), (batch, 1), device="cuda", generator=g)
    qpos = (past + torch.arange(n_max, device="cuda")[None]).clamp(max=t_max - 1)
    q = torch.randn(batch * n_max, heads, d, device="cuda", generator=g)
    got = encoder_attention(q, keys, values, slots, qpos, t_max)
    want = _reference(q, keys, values, slots, qpos, t_max)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_encoder_attention_refuses_what_it_cannot_do():
    from engines.kernels.speech_in.attention import encoder_attention

    kv = torch.zeros(2, 2, 32, 16, device="cuda")
    q = torch.zeros(4, 2, 16, device="cuda")
    with pytest.raises(ValueError, match="rows"):
        encoder_attention(q, kv, kv, torch.zeros(1, dtype=torch.long, device="cuda"),
                          torch.zeros(1, 3, dtype=torch.long, device="cuda"), 32)
    with pytest.raises(ValueError, match="float32"):
        encoder_attention(q.half(), kv, kv, torch.zeros(2, dtype=torch.long, device="cuda"),
                          torch.zeros(2, 2, dtype=torch.long, device="cuda"), 32)


@pytest.mark.parametrize("m,n,k", [(128, 3840, 1280), (300, 1280, 5120), (1100, 5120, 1280), (200, 100, 384)])
@pytest.mark.parametrize("gelu", [False, True])
def test_fp32_gemm_is_as_accurate_as_sgemm(m, n, k, gelu):
    from engines.kernels.speech_in import fp32_gemm

    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    b = torch.randn(n, device="cuda", generator=g)
    assert fp32_gemm.supported(x, w)
    ref = x.double() @ w.double().T + b.double()
    if gelu:
        ref = F.gelu(ref)
    got = fp32_gemm.linear(x, w, b, gelu=gelu)
    sgemm = F.linear(x, w, b)
    sgemm = F.gelu(sgemm) if gelu else sgemm
    err, sgemm_err = (got.double() - ref).abs().max().item(), (sgemm.double() - ref).abs().max().item()
    assert err <= max(2 * sgemm_err, 1e-6), (err, sgemm_err)


def test_fp32_gemm_rows_do_not_depend_on_their_neighbours():
    """Streamed and whole-utterance steps put a frame's row in GEMMs of different sizes (both tilings included)."""
    from engines.kernels.speech_in import fp32_gemm

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1100, 1280, device="cuda", generator=g)
    w = torch.randn(640, 1280, device="cuda", generator=g)
    whole = fp32_gemm.linear(x, w, None)
    assert torch.equal(fp32_gemm.linear(x[:300], w, None), whole[:300])
    assert torch.equal(fp32_gemm.linear(x[700:], w, None), whole[700:])


def test_fp32_gemm_leaves_small_and_other_inputs_to_torch():
    from engines.kernels.speech_in import fp32_gemm

    w = torch.randn(64, 32, device="cuda")
    assert not fp32_gemm.supported(torch.randn(fp32_gemm.MIN_ROWS - 1, 32, device="cuda"), w)
    assert not fp32_gemm.supported(torch.randn(256, 32, device="cuda").half(), w.half())
    x = torch.randn(8, 32, device="cuda")
    torch.testing.assert_close(fp32_gemm.linear(x, w, None, gelu=True), F.gelu(F.linear(x, w)))


def test_fp32_gemm_on_tf32_rows_do_not_depend_on_their_neighbours_at_any_row_count():
    """On TF32 the kernel serves every row count (cuBLAS's TF32 would sum in another order below MIN_ROWS), so a
    commit's few rows get the bits a whole-utterance step gives them."""
    from engines.kernels.speech_in import fp32_gemm

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1100, 1280, device="cuda", generator=g)
    w = torch.randn(640, 1280, device="cuda", generator=g)
    assert fp32_gemm.supported(x[:1], w, tf32=True) and not fp32_gemm.supported(x[:1], w)
    whole = fp32_gemm.linear(x, w, None, tf32=True)
    for rows in (slice(0, 1), slice(0, 3), slice(0, 300), slice(700, None)):
        assert torch.equal(fp32_gemm.linear(x[rows], w, None, tf32=True), whole[rows])


@pytest.mark.parametrize("gelu", [False, True])
def test_fp32_gemm_on_tf32_is_tf32_accurate(gelu):
    """Within TF32's rounding of float64, and clearly less accurate than 3xTF32 (the option is in effect)."""
    from engines.kernels.speech_in import fp32_gemm

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 1280, device="cuda", generator=g)
    w = torch.randn(3840, 1280, device="cuda", generator=g) / 1280 ** 0.5
    b = torch.randn(3840, device="cuda", generator=g)
    ref = x.double() @ w.double().T + b.double()
    ref = F.gelu(ref) if gelu else ref
    err = (fp32_gemm.linear(x, w, b, gelu=gelu, tf32=True).double() - ref).abs().max().item()
    err_x3 = (fp32_gemm.linear(x, w, b, gelu=gelu).double() - ref).abs().max().item()
    assert 10 * err_x3 < err < 2e-2, (err, err_x3)


def test_encoder_attention_on_tf32_is_near_sdpa():
    from engines.kernels.speech_in.attention import encoder_attention

    g = torch.Generator(device="cuda").manual_seed(4)
    batch, n_max, t_max, heads, d = 8, 16, 1000, 20, 64
    keys = torch.randn(batch + 2, heads, t_max + 8, d, device="cuda", generator=g)
    values = torch.randn(batch + 2, heads, t_max + 8, d, device="cuda", generator=g)
    slots = torch.arange(batch, device="cuda") + 1
    qpos = (t_max - n_max + torch.arange(n_max, device="cuda"))[None].expand(batch, n_max).contiguous()
    q = torch.randn(batch * n_max, heads, d, device="cuda", generator=g)
    want = _reference(q, keys, values, slots, qpos, t_max)
    got = encoder_attention(q, keys, values, slots, qpos, t_max, tf32=True)
    x3 = encoder_attention(q, keys, values, slots, qpos, t_max)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert (got - want).abs().max() > 10 * (x3 - want).abs().max()
