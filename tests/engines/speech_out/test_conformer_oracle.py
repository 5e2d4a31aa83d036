"""The flow encoder streamed chunk by chunk (KV window, conv caches, relative positions) equals a dense
full-sequence reference with the equivalent attention mask, written independently here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engines.speech_out import CodecDecoder, Voice
from engines.speech_out.flow.conformer import sinusoid
from tests.engines.speech_out.decoder_rounds import random_position_biases

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TOL = 1e-4  # float32, different op order (dense distance table vs factored sin/cos relative term, padded keys)


def _segment_front(enc, emb: torch.Tensor) -> torch.Tensor:
    """embed + pre-lookahead over one segment [T, D] (zeros after its end, zeros before its start)."""
    la = enc.pre_lookahead_layer.lookahead
    x = enc.embed(emb)
    h = F.leaky_relu(enc.pre_lookahead_layer.conv1(F.pad(x.T[None], (0, la))))
    return enc.pre_lookahead_layer.conv2(F.pad(h, (2, 0)))[0].T + x


def _segment_up(enc, x: torch.Tensor) -> torch.Tensor:
    r = enc.up_layer.stride
    up = x.repeat_interleave(r, dim=0)
    return enc.up_layer.conv(F.pad(up.T[None], (2 * r, 0)))[0].T


def _dense_layer(layer, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    a = layer.self_attn
    T, D = x.shape
    h = layer.norm_mha(x)
    q, k, v = (m(h).view(T, a.h, a.dk) for m in (a.linear_q, a.linear_k, a.linear_v))
    rel = (pos[:, None] - pos[None, :]).reshape(-1)
    p = a.linear_pos(sinusoid(rel, D)).view(T, T, a.h, a.dk)
    ac = torch.einsum("thd,lhd->htl", q + a.pos_bias_u, k)
    bd = torch.einsum("thd,tlhd->htl", q + a.pos_bias_v, p)
    att = ((ac + bd) / math.sqrt(a.dk)).masked_fill(~mask[None], float("-inf")).softmax(-1)
    x = x + a.linear_out(torch.einsum("htl,lhd->thd", att, v).reshape(T, D))
    return x + layer.feed_forward(layer.norm_ff(x))


def _mask(P: int, N: int, chunk: int, left: int, r: int) -> torch.Tensor:
    """Rows/cols: r frames per code, prompt first. Prompt sees prompt; answer chunk c sees the prompt and the
    answer codes [c*chunk - left*chunk, (c+1)*chunk)."""
    T = (P + N) * r
    code = torch.arange(T) // r
    m = torch.zeros(T, T, dtype=torch.bool)
    is_prompt = code < P
    m[is_prompt[:, None] & is_prompt[None, :]] = True
    c = torch.div(code - P, chunk, rounding_mode="floor")
    lo, hi = P + (c - left) * chunk, P + (c + 1) * chunk
    ans = ~is_prompt
    m |= ans[:, None] & (is_prompt[None, :] | ((code[None, :] >= lo[:, None]) & (code[None, :] < hi[:, None])))
    return m


def test_streamed_encoder_equals_dense_reference():
    dec = CodecDecoder.load("tiny-random", vocoder="hift", context="window")
    flow = dec.flow
    random_position_biases(flow)
    voice = Voice.random(seed=9, n_codes=7)
    codes = np.random.default_rng(1).integers(0, 16384, 38)  # 7 full chunks + a partial one; window of 4 chunks
    seen = []
    real_solve = flow._solve

    def spy(states, mu, Fr, gens, between=None):
        seen.append(mu[0].T.clone())  # [F, 80]
        return real_solve(states, mu, Fr, gens, between)

    flow._solve = spy
    s = dec.open_stream("o", voice=voice, seed=0)
    for i in range(0, len(codes), 6):
        s.push(codes[i:i + 6])
    s.finalize()
    streamed = torch.cat(seen)  # [4N, 80]

    enc, st, r = flow.encoder, dec.cfg.stream, flow.cfg.token_mel_ratio
    P, N = voice.codes.shape[0], len(codes)
    with torch.inference_mode():
        emb = flow.input_embedding
        x = torch.cat([_segment_front(enc, emb(voice.codes)), _segment_front(enc, emb(torch.as_tensor(codes)))])
        pos = torch.arange(P + N)
        mask = _mask(P, N, st.chunk_codes, st.enc_left_chunks, 1)
        for layer in enc.encoders:
            x = _dense_layer(layer, x, pos, mask)
        x = enc.up_embed(torch.cat([_segment_up(enc, x[:P]), _segment_up(enc, x[P:])]))
        pos = torch.arange((P + N) * r)
        mask = _mask(P, N, st.chunk_codes, st.enc_left_chunks, r)
        for layer in enc.up_encoders:
            x = _dense_layer(layer, x, pos, mask)
        ref = flow.encoder_proj(enc.after_norm(x))[P * r:]
    assert streamed.shape == ref.shape == (N * r, 80)
    torch.testing.assert_close(streamed, ref, atol=TOL, rtol=TOL)
    # The window matters: with full left context the last chunk's frames would differ.
    full = _mask(P, N, st.chunk_codes, 10**6, r)
    assert (full != mask).any()
