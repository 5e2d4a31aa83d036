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

from engines.speech_out.config import FlowConfig
from engines.speech_out.derived import weights_key


def frequencies(dim: int, device) -> torch.Tensor:
    """[dim / 2] float32 angular frequencies of the ESPnet sinusoid (channel 2i and 2i+1 share frequency i)."""
    return torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))


def key_factors(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """positions [R] (long) -> [R, dim]: a key's factor of the relative term (`AttnContext`), cos(pos * w_i) and
    sin(pos * w_i) interleaved. The angles in float32: positions reach ~1e4, too far for half-precision angles."""
    ang = positions.to(torch.float32)[:, None] * frequencies(dim, positions.device)  # [R, dim / 2]
    return torch.stack([torch.cos(ang), torch.sin(ang)], -1).flatten(1).to(dtype)


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
class KeyRows:
    """A layer's earlier keys where each answer holds them (CUDA: the full-context flow), read by the attention
    launch in place (engines/kernels/speech_out/flow/encoder_attention.py) instead of from a batch tensor."""

    table: torch.Tensor  # [B, 6] int64: each answer's voice buffer and its own (flow.state.key_table)
    factors: torch.Tensor  # [positions, D] the key factor of every position (`key_factors`)
    chunk: int  # the new keys' chunk width: a query sees its own chunk's new keys and earlier chunks'
    tf32: bool  # float32 products on TF32
    layer: int = 0  # which of the stack's layers


@dataclass
class AttnContext:
    """What every layer of one stack shares for a chunk, computed once per stack (not per layer).

    The relative term of a (query q, key k) pair reads the sinusoid of the distance q - k: channel 2i holds
    sin((q - k) w_i), channel 2i+1 cos((q - k) w_i). With g_s, g_c the channels of the projected query that multiply
    them, the term is sum_i Re[(g_s + i g_c) (sin(q w) - i cos(q w)) conj(e^{i k w})]: a per-query rotation and a
    per-key factor, so no table over a range of distances that grows with the answer's position, and the shapes
    depend only on the number of queries and keys."""

    q_rot: torch.Tensor  # [B, 1, T, D/2] complex64: sin(query pos * w) - i cos(query pos * w)
    # [B, D, L + T] rows cos(key pos * w_i), sin(key pos * w_i) interleaved (activation dtype); None where the keys
    # are `KeyRows` (their launch reads the factors by position)
    k_cs: torch.Tensor | None
    masked: torch.Tensor | None  # [B, 1, 1, L + T] bool, True for padding among the prefix keys

    @classmethod
    def build(cls, pos: torch.Tensor, prefix: KV | KeyRows | None, d: int, dtype: torch.dtype,
              blocked: torch.Tensor | None = None) -> AttnContext:
        """pos [B, T] query positions; prefix: the keys every layer attends to besides the chunk (their positions and
        validity are the same in every layer of a stack); blocked [T, T] bool: pairs of the chunk's own (query, key)
        that may not attend (a whole sequence under a chunk mask, `flow/reference.py`)."""
        qa = pos.to(torch.float32)[..., None] * frequencies(d, pos.device)  # [B, T, D/2]
        q_rot = torch.complex(torch.sin(qa), -torch.cos(qa))[:, None]
        if isinstance(prefix, KeyRows):
            return cls(q_rot, None, None)
        kpos = pos if prefix is None else torch.cat([prefix.pos, pos], 1)  # [B, L + T]
        B, LT = kpos.shape
        k_cs = key_factors(kpos.flatten(), d, dtype).view(B, LT, d).transpose(1, 2).contiguous()
        masked = None if prefix is None else F.pad(~prefix.valid, (0, pos.shape[1]))[:, None, None]
        if blocked is not None:
            own = F.pad(blocked, (kpos.shape[1] - pos.shape[1], 0))[None, None]  # [1, 1, T, L + T]
            masked = own if masked is None else masked | own
        return cls(q_rot, k_cs, masked)


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
        self._fused: tuple | None = None  # (weights key, q/k/v weight [3D, D], its bias [3D], pos_bias_v - u [H, dk])

    def _qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v as one GEMM whose q bias also carries pos_bias_u (every use of q adds a bias: u for the content
        term, v = u + (v - u) for the relative one). Rebuilt when a weight changes (load, dtype, device)."""
        key = weights_key(self)
        if self._fused is None or self._fused[0] != key:
            with torch.no_grad():
                w = torch.cat([self.linear_q.weight, self.linear_k.weight, self.linear_v.weight])
                b = torch.cat([self.linear_q.bias + self.pos_bias_u.flatten(), self.linear_k.bias,
                               self.linear_v.bias])
                self._fused = (key, w, b, self.pos_bias_v - self.pos_bias_u)
        return self._fused[1:]

    def forward(self, x: torch.Tensor, ctx: AttnContext, prefix: KV | KeyRows | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D]; returns output [B, T, D] and this chunk's k, v [B, T, H, dk]."""
        B, T, D = x.shape
        H, dk = self.h, self.dk
        w, b, v_minus_u = self._qkv()
        qu, k_new, v_new = F.linear(x, w, b).view(B, T, 3, H, dk).unbind(2)  # each [B, T, H, dk]; qu = q + u
        if isinstance(prefix, KeyRows):
            from engines.kernels.speech_out.flow.encoder_attention import row_attention

            rows = self._relative_rows(qu, v_minus_u, ctx).view(B, H, T, D)
            out = row_attention(qu, k_new, v_new, rows, prefix.factors, prefix.table, prefix.layer, prefix.chunk,
                                prefix.tf32)  # [B, T, H, dk]
            return self.linear_out(out.view(B, T, D)), k_new, v_new
        k, v = _heads_first(prefix.k if prefix is not None else None, k_new), \
            _heads_first(prefix.v if prefix is not None else None, v_new)  # [B, H, L + T, dk]
        L = k.shape[2]
        scores = self._relative(qu, v_minus_u, ctx)  # [B, H, T, L + T]
        if ctx.masked is not None:
            scores.masked_fill_(ctx.masked, float("-inf"))
        # scores = (relative + (q + u) k^T) / sqrt(dk), the content term's GEMM accumulating onto the relative one.
        s = 1.0 / math.sqrt(dk)
        q_h = qu.transpose(1, 2).reshape(B * H, T, dk)
        scores.view(B * H, T, L).baddbmm_(q_h, k.view(B * H, L, dk).transpose(1, 2), beta=s, alpha=s)
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, H, T, dk]
        return self.linear_out(out.transpose(1, 2).reshape(B, T, D)), k_new, v_new

    def relative(self, q: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """q [B, T, H, dk] -> the relative-position term [B, H, T, L + T]: sum_j sinusoid(q - k)_j g_j with
        g = (q + pos_bias_v) projected through linear_pos (per head)."""
        return self._relative(q, self.pos_bias_v, ctx)

    def _relative(self, q: torch.Tensor, bias: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """The relative term of queries q + bias (q [B, T, H, dk], bias [H, dk]), in four kernels: the biased
        queries head-first, their projection per head, the per-query rotation (one complex product), and one GEMM
        against the per-key factors."""
        B, T, H, _ = q.shape
        return torch.bmm(self._relative_rows(q, bias, ctx), ctx.k_cs).view(B, H, T, -1)

    def _relative_rows(self, q: torch.Tensor, bias: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """`_relative` up to its GEMM: [B, H * T, D] in q's dtype, the rows that multiply the per-key factors."""
        B, T, H, dk = q.shape
        D = H * dk
        qb = torch.empty(H, B, T, dk, device=q.device, dtype=q.dtype)
        torch.add(q.permute(2, 0, 1, 3), bias[:, None, None], out=qb)
        g = torch.bmm(qb.view(H, B * T, dk), self.linear_pos.weight.view(H, dk, D))  # [H, B*T, D]
        # Channels (2i, 2i+1) of g multiply (sin, cos) of the distance: as a complex number g_s + i g_c.
        g_c = torch.view_as_complex(g.float().view(H, B, T, D // 2, 2)).transpose(0, 1)  # [B, H, T, D/2]
        rot = torch.empty(B, H, T, D // 2, device=q.device, dtype=ctx.q_rot.dtype)
        torch.mul(g_c, ctx.q_rot, out=rot)  # (re, im) = what multiplies (cos, sin) of the key angle
        return torch.view_as_real(rot).view(B, H * T, D).to(q.dtype)


def _heads_first(prefix: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Keys or values [B, L, H, dk] (or None) and [B, T, H, dk] -> [B, H, L + T, dk] dense, in one op."""
    return torch.cat([t.transpose(1, 2) for t in ([new] if prefix is None else [prefix, new])], 2)


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

    def fuse(self) -> None:
        """Build every layer's fused q/k/v now (after loading or a move), so that no CUDA graph capture builds them."""
        for layer in (*self.encoders, *self.up_encoders):
            layer.self_attn._qkv()

    def empty_cache(self, batch: int, device, dtype) -> EncoderCache:
        d = self.cfg.d_model
        return EncoderCache(torch.zeros(batch, 2, d, device=device, dtype=dtype),
                            torch.zeros(batch, 2 * self.cfg.token_mel_ratio, d, device=device, dtype=dtype))

    def forward_chunk(self, tok: torch.Tensor, lookahead_valid: torch.Tensor, cache: EncoderCache,
                      pos: torch.Tensor, up_pos: torch.Tensor,
                      prefixes: list[KV | None], up_prefixes: list[KV | None],
                      blocked: torch.Tensor | None = None, up_blocked: torch.Tensor | None = None):
        """tok [B, n + lookahead, input] token embeddings; lookahead_valid [B, n + lookahead] bool.
        pos [B, n] code positions; up_pos [B, n*ratio] frame positions.
        The prefixes of one stack share positions and validity (only k/v differ per layer). blocked [n, n] and
        up_blocked [n*ratio, n*ratio] bool: the chunk's own (query, key) pairs that may not attend (default none).
        Returns hidden [B, n*ratio, D], new cache, and per layer (k, v) of this chunk for both stacks.
        No host syncs and no branching on tensor values: a CUDA graph can capture it."""
        d, dt = self.cfg.d_model, tok.dtype
        x = self.embed(tok) * lookahead_valid[..., None].to(dt)
        x, pre = self.pre_lookahead_layer(x, cache.pre)
        kvs = []
        ctx = AttnContext.build(pos, prefixes[0] if prefixes else None, d, dt, blocked)
        for layer, prefix in zip(self.encoders, prefixes, strict=True):
            x, k, v = layer(x, ctx, prefix)
            kvs.append((k, v))
        x, up = self.up_layer(x, cache.up)
        x = self.up_embed(x)
        up_kvs = []
        ctx = AttnContext.build(up_pos, up_prefixes[0] if up_prefixes else None, d, dt, up_blocked)
        for layer, prefix in zip(self.up_encoders, up_prefixes, strict=True):
            x, k, v = layer(x, ctx, prefix)
            up_kvs.append((k, v))
        return self.after_norm(x), EncoderCache(pre, up), kvs, up_kvs
