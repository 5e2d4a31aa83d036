"""Flow estimator and solver: bfloat16 close to float32, merged convs and the optimised estimator equal the
straightforward computation, a solve in pieces, and Euler steps equal a straightforward solve."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.speech_out import CodecDecoder
from tests.engines.speech_out.decoder_rounds import _codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bf16_estimator_runs_close_to_float32():
    codes = _codes(13, seed=4)
    f32 = CodecDecoder.load("tiny-random", vocoder="hift")
    ref = f32.decode(codes, seed=0)
    other_seed = f32.decode(codes, seed=1)
    bf = CodecDecoder.load("tiny-random", vocoder="hift", estimator_dtype="bfloat16").decode(codes, seed=0)
    assert bf.shape == ref.shape and np.isfinite(bf).all()
    # bf16 rounding must move the waveform far less than changing the session's noise does.
    assert np.abs(ref - bf).max() < 0.1 * np.abs(ref - other_seed).max()


def _reference_estimator(est, x, mu, t, spks, cond, mask):
    """The estimator written out straightforwardly (per-row time MLP, separate q/k/v GEMMs, bool mask, pad + conv,
    unfused LayerNorm/Mish) from the same weights: the optimised path must compute the same function."""
    import math

    import torch.nn.functional as F

    def causal_conv(conv, h):
        return F.conv1d(F.pad(h, (conv.kernel_size[0] - 1, 0)), conv.weight, conv.bias)

    def block(b, h):
        conv, norm = b.block[0], b.block[2]
        h = causal_conv(conv, h).transpose(1, 2)
        return F.mish(F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps).transpose(1, 2))

    def resnet(r, h, temb):
        h1 = block(r.block1, h) + r.mlp(temb)[:, :, None]
        return block(r.block2, h1) + r.res_conv(h)

    def transformer(tb, h):
        B, T, _ = h.shape
        a = tb.attn1
        n = tb.norm1(h)
        q, k, v = (m(n).view(B, T, a.h, a.dh).transpose(1, 2) for m in (a.to_q, a.to_k, a.to_v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + a.to_out[0](o.transpose(1, 2).reshape(B, T, a.h * a.dh))
        return h + tb.ff.net[2](F.gelu(tb.ff.net[0].proj(tb.norm3(h))))

    def attend(h, blocks):
        h = h.transpose(1, 2)
        for tb in blocks:
            h = transformer(tb, h)
        return h.transpose(1, 2)

    half = est.in_channels // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
    ang = 1000.0 * t.float()[:, None] * freq[None]
    temb = est.time_mlp(torch.cat([ang.sin(), ang.cos()], dim=-1))
    h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)
    r, blocks, down = est.down_blocks[0]
    h = attend(resnet(r, h, temb), blocks)
    skip = h
    h = causal_conv(down, h)
    for r, blocks in est.mid_blocks:
        h = attend(resnet(r, h, temb), blocks)
    r, blocks, up = est.up_blocks[0]
    h = causal_conv(up, attend(resnet(r, torch.cat([h, skip], dim=1), temb), blocks))
    return est.final_proj(block(est.final_block, h))


@torch.inference_mode()
def test_merged_conv_weight_computes_block1_conv_and_res_conv(hift_dec):
    """The CUDA resnet's one conv weight (block1's conv | res_conv on the last tap) read as the CUDA kernels read it
    (an implicit GEMM over the shifted frames) gives both convs' outputs."""
    from engines.speech_out.flow.estimator import _conv_with_pointwise

    r = hift_dec.flow.decoder.estimator.mid_blocks[0][0]
    conv = r.block1.block[0]
    w, b = _conv_with_pointwise(conv, r.res_conv)
    k, cin, T = conv.kernel_size[0], conv.in_channels, 9
    x = torch.randn(2, cin, T, generator=torch.Generator().manual_seed(1))
    xp = torch.nn.functional.pad(x, (k - 1, 0))
    # out[:, :, t] = b + sum over taps of W[tap * Cin:(tap + 1) * Cin].T @ x[:, :, t - (k - 1) + tap]
    got = b[None, :, None] + sum(torch.einsum("bct,cn->bnt", xp[:, :, tap:tap + T], w[tap * cin:(tap + 1) * cin])
                                 for tap in range(k))
    want = torch.cat([conv(x), r.res_conv(x)], dim=1)
    assert w.shape == (k * cin, 2 * conv.out_channels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_optimised_estimator_equals_straightforward_computation(window_dec):
    """Time table per Euler step + fused q/k/v + additive window mask + fused tails == the plain computation."""
    flow = window_dec.flow
    est = flow.decoder.estimator
    C, F_ = window_dec.cfg.stream.est_ctx_frames, 4 * window_dec.cfg.stream.chunk_codes
    W, B = C + F_, 3
    g = torch.Generator().manual_seed(0)
    x, mu, cond = (torch.randn(B, 80, W, generator=g) for _ in range(3))
    spks = torch.randn(B, 80, generator=g)
    idx = torch.arange(W)
    bool_mask = (idx[None, :] < C) | (idx[:, None] >= C)
    from engines.speech_out.flow.estimator import window_mask

    table = est.time_table(flow.t_span, torch.float32)
    h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)
    for s in range(flow.cfg.n_timesteps):
        t = torch.full((B,), flow.t_span[s])
        want = _reference_estimator(est, x, mu, t, spks, cond, bool_mask)
        got = est.run(h, table[s], window_mask(W, C, torch.device("cpu"), torch.float32))
        scale = want.abs().max()
        assert scale > 1e-3
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(scale))
        # The arbitrary-t entry point runs the same core.
        torch.testing.assert_close(est(x, mu, t, spks, cond, bool_mask), want, rtol=0, atol=1e-5 * float(scale))
    # The table follows the weights: an in-place change is noticed.
    w = est.mid_blocks[0][0].mlp[1].bias
    w.add_(1.0)
    try:
        assert not torch.equal(est.time_table(flow.t_span, torch.float32), table)
    finally:
        w.sub_(1.0)


def test_a_solve_in_pieces_gives_the_same_pcm_and_yields_between_them(window_dec):
    """FlowModel.solve_parts: a full chunk's Euler steps run as consecutive pieces, with run_jobs' `between` after the
    encoder and each piece; a last partial chunk runs whole. The PCM is that of the whole solve, bit for bit."""
    codes = _codes(23, seed=5)
    want = window_dec.stream_all(codes, seed=3)
    steps = window_dec.cfg.flow.n_timesteps
    calls: list[int] = []
    window_dec.flow.solve_parts = 2
    try:
        full = 4 * window_dec.cfg.stream.chunk_codes
        assert window_dec.flow.step_ranges(full) == [(0, steps // 2), (steps // 2, steps)]
        assert window_dec.flow.step_ranges(4) == [(0, steps)]
        s = window_dec.open_stream("pieces", seed=3)
        s.add(codes.tolist())
        jobs = s.take_jobs()
        got = [window_dec.run_jobs([j], between=lambda: calls.append(1))[0] for j in jobs]
        tail = s.take_jobs(finishing=True)
        got += [window_dec.run_jobs([j], between=lambda: calls.append(2))[0] for j in tail]
    finally:
        window_dec.flow.solve_parts = 1
    np.testing.assert_array_equal(np.concatenate(got), want)
    assert len(jobs) == 4 and calls.count(1) == 4 * (1 + 2)  # encoder + 2 pieces per full chunk
    assert [len(j.codes) for j in tail] == [3] and calls.count(2) == 1 + 1  # a partial chunk: encoder + 1 piece


@torch.inference_mode()
def test_euler_equals_straightforward_solve(window_dec):
    """The Euler solve with the prebuilt input buffer and fused CFG update == the step-by-step textbook solve."""
    flow, cfg = window_dec.flow, window_dec.cfg
    est = flow.decoder.estimator
    C, F_ = cfg.stream.est_ctx_frames, 4 * cfg.stream.chunk_codes
    B = 2
    g = torch.Generator().manual_seed(1)
    z = torch.randn(B, 80, F_, generator=g)
    ctx = torch.randn(B, cfg.flow.n_timesteps, 80, C, generator=g)
    mu, cond = (torch.randn(B, 80, C + F_, generator=g) for _ in range(2))
    spks = torch.randn(B, 80, generator=g)
    got_x, got_traj = flow.euler(z, ctx, mu, cond, spks)
    idx = torch.arange(C + F_)
    mask = (idx[None, :] < C) | (idx[:, None] >= C)
    x, r = z, cfg.flow.cfg_rate
    for s in range(cfg.flow.n_timesteps):
        torch.testing.assert_close(got_traj[:, s], x, rtol=0, atol=1e-5)
        t0, t1 = flow.t_span[s], flow.t_span[s + 1]
        xw = torch.cat([ctx[:, s], x], dim=2)
        t = torch.full((2 * B,), t0)
        v = _reference_estimator(est, torch.cat([xw, xw]), torch.cat([mu, 0 * mu]), t,
                                 torch.cat([spks, 0 * spks]), torch.cat([cond, 0 * cond]), mask)
        x = x + (t1 - t0) * ((1 + r) * v[:B] - r * v[B:])[:, :, C:]
    assert x.abs().max() > 1e-3
    torch.testing.assert_close(got_x, x, rtol=0, atol=1e-5 * float(x.abs().max()))
