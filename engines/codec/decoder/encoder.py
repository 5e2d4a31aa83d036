"""Upsampling conformer encoder of the flow (codes -> 4 hidden frames per code), run chunk by chunk.

Layout follows the published checkpoint keys (`encoder.embed.out.{0,1}`, `encoder.pre_lookahead_layer.conv{1,2}`,
`encoder.encoders.N.{self_attn.linear_{q,k,v,out,pos},pos_bias_{u,v},feed_forward.w_{1,2},norm_mha,norm_ff}`,
`encoder.up_layer.conv`, `encoder.up_embed.out.{0,1}`, `encoder.up_encoders.N...`, `encoder.after_norm`).
Streaming is exact by construction: every chunk attends to the prompt, a fixed window of previous chunks
and itself, and the two convolutions carry their left context in small caches, so decoding a chunk costs the
same however long the answer is.

Shapes are static for a given (batch, chunk, prefix length): the relative-position term is computed from per-query
and per-key sin/cos (no table over a position-dependent range of distances), so one chunk at any point of an answer
runs the same kernels on the same shapes and can be replayed as a CUDA graph (`FlowModel.encode`, `EncoderGraphs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.codec.decoder.config import FlowConfig


def frequencies(dim: int, device) -> torch.Tensor:
    """[dim / 2] float32 angular frequencies of the ESPnet sinusoid (channel 2i and 2i+1 share frequency i)."""
    return torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """positions [R] (signed) -> [R, dim], sin on even and cos on odd channels (ESPnet rel-pos table)."""
    ang = positions.to(torch.float32)[:, None] * frequencies(dim, positions.device)[None]
    out = torch.empty(positions.shape[0], dim, device=positions.device, dtype=torch.float32)
    out[:, 0::2] = torch.sin(ang)
    out[:, 1::2] = torch.cos(ang)
    return out


@dataclass
class KV:
    """Keys/values a chunk may attend to, besides itself. Padded across a batch; `valid` marks real keys."""

    k: torch.Tensor  # [B, L, H, dk]
    v: torch.Tensor  # [B, L, H, dk]
    pos: torch.Tensor  # [B, L] absolute positions (long)
    valid: torch.Tensor  # [B, L] bool


@dataclass
class AttnContext:
    """What every layer of one stack shares for a chunk, computed once per stack (not per layer).

    The relative term of a (query q, key k) pair reads the sinusoid of the distance q - k. With w_i the frequencies,
    sin((q - k) w) = Sq Ck - Cq Sk and cos((q - k) w) = Cq Ck + Sq Sk (Sq = sin(q w), Ck = cos(k w), ...), so it
    factors into a per-query part and a per-key part: no table over a range of distances that grows with the
    answer's position, and the shapes depend only on the number of queries and keys."""

    q_sin: torch.Tensor  # [B, 1, T, D/2] sin(query pos * w) (activation dtype)
    q_cos: torch.Tensor  # [B, 1, T, D/2]
    k_cs: torch.Tensor  # [B, 1, D, L + T] [cos(key pos * w); sin(key pos * w)], transposed for the matmul
    masked: torch.Tensor | None  # [B, 1, 1, L + T] bool, True for padding among the prefix keys

    @classmethod
    def build(cls, pos: torch.Tensor, prefix: KV | None, d: int, dtype: torch.dtype) -> AttnContext:
        """pos [B, T] query positions; prefix: the keys every layer attends to besides the chunk (their positions and
        validity are the same in every layer of a stack)."""
        w = frequencies(d, pos.device)  # [D/2] float32: positions reach ~1e4, too far for bf16 angles
        kpos = pos if prefix is None else torch.cat([prefix.pos, pos], 1)  # [B, L + T]
        qa = pos.to(torch.float32)[..., None] * w  # [B, T, D/2]
        ka = kpos.to(torch.float32)[..., None] * w  # [B, L + T, D/2]
        k_cs = torch.cat([torch.cos(ka), torch.sin(ka)], -1).transpose(1, 2)[:, None].to(dtype)
        masked = None if prefix is None else F.pad(~prefix.valid, (0, pos.shape[1]))[:, None, None]
        return cls(torch.sin(qa)[:, None].to(dtype), torch.cos(qa)[:, None].to(dtype), k_cs, masked)


class LinearEmbed(nn.Module):
    """Linear + LayerNorm, scaled by sqrt(d) the way the rel-pos encoding layer does."""

    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(d_in, d), nn.LayerNorm(d, eps=1e-5))
        self.xscale = math.sqrt(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPosSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.linear_q = nn.Linear(d, d)
        self.linear_k = nn.Linear(d, d)
        self.linear_v = nn.Linear(d, d)
        self.linear_out = nn.Linear(d, d)
        self.linear_pos = nn.Linear(d, d, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.dk))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.dk))

    def forward(self, x: torch.Tensor, ctx: AttnContext, prefix: KV | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D]; returns output [B, T, D] and this chunk's k, v [B, T, H, dk]."""
        B, T, D = x.shape
        q = self.linear_q(x).view(B, T, self.h, self.dk)
        k_new = self.linear_k(x).view(B, T, self.h, self.dk)
        v_new = self.linear_v(x).view(B, T, self.h, self.dk)
        if prefix is None:
            k, v = k_new, v_new
        else:
            k = torch.cat([prefix.k, k_new], 1)
            v = torch.cat([prefix.v, v_new], 1)
        ac = torch.einsum("bthd,blhd->bhtl", q + self.pos_bias_u, k)
        bd = self.relative(q, ctx)
        scores = (ac + bd) / math.sqrt(self.dk)
        if ctx.masked is not None:
            scores = scores.masked_fill(ctx.masked, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhtl,blhd->bthd", attn, v).reshape(B, T, D)
        return self.linear_out(out), k_new, v_new

    def relative(self, q: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """q [B, T, H, dk] -> the relative-position term [B, H, T, L + T]: sum_j sinusoid(q - k)_j g_j with
        g = (q + pos_bias_v) projected through linear_pos (per head), split over the factors of AttnContext."""
        D = self.h * self.dk
        wp = self.linear_pos.weight.view(self.h, self.dk, D)  # [H, dk, D]
        g = torch.einsum("bthc,hcj->bhtj", q + self.pos_bias_v, wp)  # [B, H, T, D]
        g_sin, g_cos = g[..., 0::2], g[..., 1::2]  # the channels that multiply sin / cos of the distance
        # sin channels: g_sin (Sq Ck - Cq Sk); cos channels: g_cos (Cq Ck + Sq Sk). Grouped by Ck and Sk:
        on_cos = g_sin * ctx.q_sin + g_cos * ctx.q_cos  # [B, H, T, D/2]
        on_sin = g_cos * ctx.q_sin - g_sin * ctx.q_cos
        return torch.cat([on_cos, on_sin], -1) @ ctx.k_cs  # [B, H, T, L + T]


class FeedForward(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d, ffn)
        self.w_2 = nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm attention + feed-forward (the checkpoint's conformer has no conv module and no macaron FFN)."""

    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = RelPosSelfAttention(d, heads)
        self.feed_forward = FeedForward(d, ffn)
        self.norm_mha = nn.LayerNorm(d, eps=1e-12)
        self.norm_ff = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x, ctx, prefix):
        a, k, v = self.self_attn(self.norm_mha(x), ctx, prefix)
        x = x + a
        x = x + self.feed_forward(self.norm_ff(x))
        return x, k, v


class PreLookahead(nn.Module):
    """conv1 reads `lookahead` codes to the right; conv2 (kernel 3) reads two conv1 outputs to the left."""

    def __init__(self, d: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(d, d, lookahead + 1)
        self.conv2 = nn.Conv1d(d, d, 3)

    def forward(self, x: torch.Tensor, left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n + lookahead, D] (absent lookahead already zeroed), left [B, 2, D] previous conv1 outputs.
        Returns [B, n, D] and the new left cache."""
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)))  # [B, D, n]
        h = torch.cat([left.transpose(1, 2), h], dim=2)
        out = self.conv2(h).transpose(1, 2)  # [B, n, D]
        n = out.shape[1]
        return out + x[:, :n], h[:, :, -2:].transpose(1, 2)


class Upsample(nn.Module):
    """Nearest repeat x stride, then a causal conv of kernel 2*stride+1 (its left context is cached)."""

    def __init__(self, d: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(d, d, 2 * stride + 1)

    def forward(self, x: torch.Tensor, left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, D], left [B, 2*stride, D] -> [B, n*stride, D] and the new left cache."""
        up = x.repeat_interleave(self.stride, dim=1)
        h = torch.cat([left, up], dim=1)
        return self.conv(h.transpose(1, 2)).transpose(1, 2), h[:, -2 * self.stride:]


@dataclass
class EncoderCache:
    """Per-batch-row left state of the two convolutions."""

    pre: torch.Tensor  # [B, 2, D]
    up: torch.Tensor  # [B, 2*ratio, D]


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.embed = LinearEmbed(cfg.input_size, d)
        self.pre_lookahead_layer = PreLookahead(d, cfg.pre_lookahead)
        self.encoders = nn.ModuleList(ConformerLayer(d, cfg.heads, cfg.ffn) for _ in range(cfg.num_blocks))
        self.up_layer = Upsample(d, cfg.token_mel_ratio)
        self.up_embed = LinearEmbed(d, d)
        self.up_encoders = nn.ModuleList(ConformerLayer(d, cfg.heads, cfg.ffn) for _ in range(cfg.num_up_blocks))
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def empty_cache(self, batch: int, device, dtype) -> EncoderCache:
        d = self.cfg.d_model
        return EncoderCache(torch.zeros(batch, 2, d, device=device, dtype=dtype),
                            torch.zeros(batch, 2 * self.cfg.token_mel_ratio, d, device=device, dtype=dtype))

    def forward_chunk(self, tok: torch.Tensor, lookahead_valid: torch.Tensor, cache: EncoderCache,
                      pos: torch.Tensor, up_pos: torch.Tensor,
                      prefixes: list[KV | None], up_prefixes: list[KV | None]):
        """tok [B, n + lookahead, input] token embeddings; lookahead_valid [B, n + lookahead] bool.
        pos [B, n] code positions; up_pos [B, n*ratio] frame positions.
        The prefixes of one stack share positions and validity (only k/v differ per layer).
        Returns hidden [B, n*ratio, D], new cache, and per layer (k, v) of this chunk for both stacks.
        No host syncs and no branching on tensor values: a CUDA graph can capture it."""
        d, dt = self.cfg.d_model, tok.dtype
        x = self.embed(tok) * lookahead_valid[..., None].to(dt)
        x, pre = self.pre_lookahead_layer(x, cache.pre)
        kvs = []
        ctx = AttnContext.build(pos, prefixes[0] if prefixes else None, d, dt)
        for layer, prefix in zip(self.encoders, prefixes, strict=True):
            x, k, v = layer(x, ctx, prefix)
            kvs.append((k, v))
        x, up = self.up_layer(x, cache.up)
        x = self.up_embed(x)
        up_kvs = []
        ctx = AttnContext.build(up_pos, up_prefixes[0] if up_prefixes else None, d, dt)
        for layer, prefix in zip(self.up_encoders, up_prefixes, strict=True):
            x, k, v = layer(x, ctx, prefix)
            up_kvs.append((k, v))
        return self.after_norm(x), EncoderCache(pre, up), kvs, up_kvs
