"""The LM's fused elementwise kernels (add+RMSNorm, q/k norm+RoPE+KV write, SiLU*up, embedding+RoPE) against the
torch path. Run: python3 -m pytest tests/gpu (needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.lm_kernel_cases import _torch_rmsnorm, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rmsnorm_matches_torch(dtype):
    from engines.kernels.lm.fused import add_rmsnorm

    g = torch.Generator(device="cuda").manual_seed(0)
    for t, n in [(1, 4096), (37, 4096), (5, 64)]:
        x = torch.randn(t, n, device="cuda", generator=g).to(dtype)
        r = torch.randn(t, n, device="cuda", generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
        out, res = add_rmsnorm(x, r, w, 1e-6)
        assert torch.equal(res, x + r)
        assert rel_err(out, _torch_rmsnorm(x + r, w, 1e-6)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
        out0, _ = add_rmsnorm(x, None, w, 1e-6)
        assert rel_err(out0, _torch_rmsnorm(x, w, 1e-6)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("block_size", [1, 16])
def test_fused_qk_norm_rope_kv_write_matches_torch(block_size):
    from engines.kernels.lm.fused import qk_norm_rope_write_kv
    from engines.lm.model.attention import write_kv
    from engines.lm.model.rope import apply_rope, rope_cos_sin, rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(1)
    t, h, kvh, d, dtype = 19, 32, 8, 128, torch.bfloat16
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", generator=g).to(dtype)
    qw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    pos = torch.randint(0, 5000, (t,), device="cuda", generator=g)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(d, 1e6).cuda(), dtype)
    slots = torch.randperm(64 * block_size, device="cuda", generator=g)[:t]
    caches = [torch.full((64, block_size, kvh, d), float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
    q = qk_norm_rope_write_kv(qkv, qw, kw, cos, sin, caches[0], caches[1], slots, h, kvh, 1e-6)
    q_ref, k_ref, v_ref = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q_ref = apply_rope(_torch_rmsnorm(q_ref.reshape(t, h, d), qw, 1e-6), cos, sin)
    k_ref = apply_rope(_torch_rmsnorm(k_ref.reshape(t, kvh, d), kw, 1e-6), cos, sin)
    write_kv(k_ref, v_ref.reshape(t, kvh, d), caches[2], caches[3], slots)
    assert rel_err(q, q_ref) < 1e-2
    written = caches[0].view(-1, kvh, d)[slots]
    assert torch.isfinite(written).all()
    assert rel_err(written, caches[2].view(-1, kvh, d)[slots]) < 1e-2
    assert torch.equal(caches[1].view(-1, kvh, d)[slots], caches[3].view(-1, kvh, d)[slots])


def test_fused_write_into_an_fp8_cache_stores_the_torch_paths_values():
    """Keys (normed and rotated, rounded to bf16 first) and values into an fp8 cache: the bf16 cache's values cast
    as engines.config.to_cache casts them, saturated beyond +-448, bit for bit."""
    from engines.config import to_cache
    from engines.kernels.lm.fused import qk_norm_rope_write_kv
    from engines.lm.model.rope import rope_cos_sin, rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(2)
    t, h, kvh, d, dtype = 37, 32, 8, 128, torch.bfloat16
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", generator=g).to(dtype)
    qkv[:, (h + kvh) * d:] *= 300  # values beyond e4m3's range
    qw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    kw = (300 * torch.randn(d, device="cuda", generator=g)).to(dtype)  # keys over e4m3's range too
    pos = torch.randint(0, 5000, (t,), device="cuda", generator=g)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(d, 1e6).cuda(), dtype)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:t]
    plain = [torch.zeros(64, 16, kvh, d, device="cuda", dtype=dtype) for _ in range(2)]
    fp8 = [torch.zeros(64, 16, kvh, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2)]
    q = qk_norm_rope_write_kv(qkv, qw, kw, cos, sin, plain[0], plain[1], slots, h, kvh, 1e-6)
    q8 = qk_norm_rope_write_kv(qkv, qw, kw, cos, sin, fp8[0], fp8[1], slots, h, kvh, 1e-6)
    assert torch.equal(q, q8)
    for a, b in zip(plain, fp8, strict=True):
        rows = a.view(-1, kvh, d)[slots]
        assert rows.abs().max() > 448
        got, want = b.view(-1, kvh, d)[slots].float(), to_cache(rows, torch.float8_e4m3fn).float()
        bad = (got != want).nonzero()[:4].tolist()
        assert not bad, [(rows[tuple(i)].item(), got[tuple(i)].item(), want[tuple(i)].item()) for i in bad]


def test_fused_silu_mul_matches_torch():
    from engines.kernels.lm.fused import silu_mul

    g = torch.Generator(device="cuda").manual_seed(2)
    gu = torch.randn(7, 2 * 12288, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = gu.split(12288, dim=-1)
    assert rel_err(silu_mul(gu), torch.nn.functional.silu(gate) * up) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed_rope_kernel_equals_embed_and_rope_cos_sin(dtype):
    """The step's first kernel gives the bits of MossSpeechModel.embed and rope_cos_sin: audio rows (text id
    modality_pad) look up their audio id, text rows their text id whatever audio id they carry, and cos/sin of
    positions up to the model's longest."""
    from engines.config import model_config_for
    from engines.kernels.lm.fused import embed_rope
    from engines.lm.model.moss import MossSpeechModel
    from engines.lm.model.rope import rope_cos_sin
    from engines.tokens import MODALITY_PAD

    model = MossSpeechModel(model_config_for("tiny-random"), device="cuda", dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(31)
    for emb in (model.embed_tokens, model.audio_embed):
        emb.weight.data.copy_(torch.randn(emb.weight.shape, device="cuda", generator=g))
    t = 300
    text = torch.randint(0, model.config.vocab_size, (t,), device="cuda", generator=g)
    text[::3] = MODALITY_PAD
    rows = torch.stack([text, torch.randint(0, model.config.audio_vocab_size, (t,), device="cuda", generator=g)], 1)
    positions = torch.randint(0, 8192, (t,), device="cuda", generator=g)
    positions[:4] = torch.tensor([0, 1, 4095, 8191])
    x, cos, sin = embed_rope(rows, positions, model.embed_tokens.weight, model.audio_embed.weight, model.inv_freq,
                             MODALITY_PAD)
    ref_cos, ref_sin = rope_cos_sin(positions, model.inv_freq, dtype)
    assert torch.equal(x, model.embed(rows))
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
