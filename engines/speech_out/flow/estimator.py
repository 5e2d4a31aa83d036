"""Causal conditional CFM estimator: predicts the flow velocity for mel frames given x_t, mu, speaker, cond, t.

Key layout of the checkpoint (`decoder.estimator.` prefix in flow.pt): `time_mlp.linear_{1,2}`,
`down_blocks.0.{0: resnet, 1.N: transformer, 2: causal conv}`, `mid_blocks.M.{0: resnet, 1.N: transformer}`,
`up_blocks.0.{0,1.N,2}`, `final_block.block.{0: conv, 2: layer norm}`, `final_proj`. A resnet is
`block1/block2.block.{0: causal conv k3, 2: LayerNorm}`, `mlp.1` (time projection), `res_conv`; a transformer
block is `norm1`, `attn1.to_{q,k,v}`, `attn1.to_out.0`, `norm3`, `ff.net.0.proj`, `ff.net.2`.
The estimator always sees a fixed window (context frames + current chunk), so it needs no cache of its own:
the context frames' x_t trajectories are kept by the flow.

Inference layout (GPU launch count): the time
conditioning of every resnet is a table per Euler step (`time_table`), q/k/v run as one GEMM over a
concatenated weight (`fuse`), the attention mask is an additive float mask built once per solve
(`window_mask`), and LayerNorm tails and the convolutions are Triton kernels on CUDA
(engines/kernels/speech_out/flow/), where a transformer block is 5 kernels (LayerNorms as GEMM prologues, one
attention kernel for the short window, the stack's last residual add in the last GEMM's epilogue) and a resnet 4
(block1's conv and res_conv as one conv over the same input). Activations stay
[B, C, T] in shape but time-major in memory, the layout of the transformer blocks, so no transposes are copied
between resnets and transformer blocks.
`forward` (arbitrary t, bool mask) is kept for tests and runs the same core. The kernels are imported inside the CUDA
branches: they need Triton, which a CPU-only machine may lack.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engines.speech_out.config import FlowConfig
from engines.speech_out.derived import weights_key


def conv_weight_gemm(weight: torch.Tensor) -> torch.Tensor:
    """Conv1d weight [Cout, Cin, K] -> the CUDA conv's implicit-GEMM operand [K * Cin, Cout] (row tap * Cin + c)."""
    cout, cin, k = weight.shape
    return weight.permute(2, 1, 0).reshape(k * cin, cout).contiguous()


class CausalConv1d(nn.Conv1d):
    """Conv1d seeing `kernel - 1` frames of left context (kernel 1: pointwise). On CUDA one implicit-GEMM Triton
    kernel that writes time-major memory (engines/kernels/speech_out/flow/conv.py)."""

    def __init__(self, dim: int, dim_out: int, kernel: int) -> None:
        # Padding on both sides then dropping the tail equals left padding: one kernel instead of pad + conv.
        super().__init__(dim, dim_out, kernel, padding=kernel - 1)
        # [kernel * dim, dim_out]: the weight as the CUDA kernel reads it (built by CausalConditionalDecoder.fuse).
        self.gemm_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from engines.kernels.speech_out.flow.conv import causal_conv

            w = self.gemm_weight if self.gemm_weight is not None else conv_weight_gemm(self.weight)
            return causal_conv(x, w, self.bias, self.kernel_size[0])
        return super().forward(x)[..., :x.shape[-1]]


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


def layernorm_mish(x: torch.Tensor, norm: nn.LayerNorm, row: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C, T] -> mish(LayerNorm over C) (+ row [B|1, C] over T) (+ residual [B, C, T]); one kernel on CUDA."""
    if x.is_cuda:
        from engines.kernels.speech_out.flow.norms import layernorm_mish as fused

        return fused(x, norm.weight, norm.bias, norm.eps, row, residual)
    y = F.mish(norm(x.transpose(1, 2)).transpose(1, 2))
    if row is not None:
        y = y + row[:, :, None]
    return y + residual if residual is not None else y


def add_layernorm(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.LayerNorm
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(x + residual), x + residual) for x [B, T, C]; one kernel on CUDA."""
    if x.is_cuda:
        from engines.kernels.speech_out.flow.norms import add_layernorm as fused

        return fused(x, residual, norm.weight, norm.bias, norm.eps)
    if residual is not None:
        x = x + residual
    return norm(x), x


class CausalBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # Indices match the checkpoint: 0 conv, 2 LayerNorm (1 and 3 are transposes, 4 Mish).
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out), _Transpose(),
                                   nn.Mish())

    def forward(self, x: torch.Tensor, row: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        return layernorm_mish(self.block[0](x), self.block[2], row, residual)


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = CausalConv1d(dim, dim_out, 1)
        # [3 * dim, 2 * dim_out] and [2 * dim_out]: block1's conv and res_conv as one conv over the same input (res_conv
        # is the last tap of the extra output columns); built by CausalConditionalDecoder.fuse for the CUDA path.
        self.conv1_res_gemm: torch.Tensor | None = None
        self.conv1_res_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, t_row: torch.Tensor) -> torch.Tensor:
        """x [B, dim, T]; t_row [B|1, dim_out] = self.mlp(time embedding), precomputed per Euler step."""
        if x.is_cuda and self.conv1_res_gemm is not None:
            return self._forward_cuda(x, t_row)
        return self.block2(self.block1(x, row=t_row), residual=self.res_conv(x))

    def _forward_cuda(self, x: torch.Tensor, t_row: torch.Tensor) -> torch.Tensor:
        """forward in 4 kernels: block1's conv and res_conv as one conv over x, then block1's LayerNorm + Mish +
        time row, block2's conv, block2's LayerNorm + Mish + residual."""
        from engines.kernels.speech_out.flow.conv import causal_conv

        c = self.conv1_res_bias.shape[0] // 2
        both = causal_conv(x, self.conv1_res_gemm, self.conv1_res_bias, self.block1.block[0].kernel_size[0])
        h = layernorm_mish(both[:, :c], self.block1.block[2], row=t_row)  # both: [B, 2C, T] = block1 conv | res
        return self.block2(h, residual=both[:, c:])


class _GELUProj(nn.Module):
    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.h, self.dh = heads, head_dim
        self.to_q = nn.Linear(d, heads * head_dim, bias=False)
        self.to_k = nn.Linear(d, heads * head_dim, bias=False)
        self.to_v = nn.Linear(d, heads * head_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, d)])
        # [3 * heads * head_dim, d]: to_q, to_k, to_v stacked (built by CausalConditionalDecoder.fuse; a plain
        # attribute, so the checkpoint keeps its separate q/k/v keys).
        self.qkv_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; mask additive float [T, T] (0 = may attend, -inf = not)."""
        B, T, _ = x.shape
        qkv = F.linear(x, self.qkv_weight).view(B, T, 3, self.h, self.dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, dh]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](o.transpose(1, 2).reshape(B, T, self.h * self.dh))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn1 = _Attention(d, heads, head_dim)
        self.norm3 = nn.LayerNorm(d)
        self.ff = nn.Module()
        self.ff.net = nn.ModuleList([_GELUProj(d, 4 * d), nn.Dropout(0.0), nn.Linear(4 * d, d)])

        # [d, 3 * heads * head_dim] and [d, 4 * d]: q/k/v and ff.net.0 weights transposed for the CUDA kernels (built
        # by CausalConditionalDecoder.fuse).
        self.qkv_t: torch.Tensor | None = None
        self.ff1_t: torch.Tensor | None = None

    def _fused_ok(self, x: torch.Tensor) -> bool:
        """The CUDA kernels take a power-of-two width (one tile per row) and windows of <= 128 frames."""
        from engines.kernels.speech_out.flow.attention import WINDOW_ATTENTION_MAX_T

        d, dh = x.shape[2], self.attn1.dh
        return (self.qkv_t is not None and d & (d - 1) == 0 and d >= 16 and dh & (dh - 1) == 0 and dh >= 16
                and x.shape[1] <= WINDOW_ATTENTION_MAX_T)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, mask: torch.Tensor, last: bool = False,
                windows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's input is x + pending (pending None: just x); returns (x, ff_out) whose sum is its output,
        so each residual add fuses with the next LayerNorm. The last block of a stack returns (output, None).
        windows: the windows (rows of x) of every call running side by side with this one (default x's own)."""
        if x.is_cuda and self._fused_ok(x):
            return self._forward_cuda(x, pending, mask, last, windows)
        return self.around(x, pending, lambda h: self.attn1(h, mask), last)

    def around(self, x: torch.Tensor, pending: torch.Tensor | None, attend: Callable[[torch.Tensor], torch.Tensor],
               last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block in torch ops around `attend` (the normed stream h [B, T, d] -> its attention's projected output
        [B, T, d]); returns (x, ff_out) as `forward` does."""
        h, x = add_layernorm(x, pending, self.norm1)
        h, x = add_layernorm(x, attend(h), self.norm3)
        ff = self.ff.net[2](self.ff.net[0](h))
        return (x + ff, None) if last else (x, ff)

    def _forward_cuda(self, x: torch.Tensor, pending: torch.Tensor | None, mask: torch.Tensor, last: bool,
                      windows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward in 5 kernels: add + LayerNorm + q/k/v GEMM, window attention, then `after_attention`'s three;
        the first two as one kernel where `ln_qkv_attention_fits` (same bits)."""
        from engines.kernels.speech_out.flow import attention, gemm

        a, n1 = self.attn1, self.norm1
        if attention.ln_qkv_attention_fits(x, a.dh, windows):
            att, x = attention.ln_qkv_attention(x, pending, n1.weight, n1.bias, n1.eps, self.qkv_t, mask, a.h, a.dh)
        else:
            qkv, x = gemm.ln_linear(x, pending, n1.weight, n1.bias, n1.eps, self.qkv_t)
            att = attention.window_attention(qkv, mask, a.h, a.dh)  # [B, T, heads * dh]
        return self.after_attention(x, att, last)

    def after_attention(self, x: torch.Tensor, att: torch.Tensor, last: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CUDA kernels after the attention `att` [B, T, heads * dh] of the block's stream x [B, T, d]: to_out
        GEMM, add + LayerNorm + ff GEMM + GELU, ff output GEMM (+ the residual stream, for the last block). Returns
        (x, ff_out) as `forward` does."""
        from engines.kernels.speech_out.flow import gemm

        out, ff = self.attn1.to_out[0], self.ff.net
        o = gemm.linear(att, out.weight, out.bias)  # [B, T, d]
        h, x = gemm.ln_linear(x, o, self.norm3.weight, self.norm3.bias, self.norm3.eps, self.ff1_t, ff[0].proj.bias,
                              gelu=True)
        if last:
            return gemm.linear(h, ff[2].weight, ff[2].bias, residual=x), None
        return x, gemm.linear(h, ff[2].weight, ff[2].bias)


class _TimeMLP(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d)
        self.linear_2 = nn.Linear(d, d)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(t)))


def timestep_embedding(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """t [B] in [0, 1] -> [B, dim] (sin half, cos half)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
    ang = scale * t.float()[:, None] * freq[None]
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


def window_mask(W: int, ctx: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [W, W] of the estimator window: context frames attend only to context, new frames
    to everything. Stored with its rows padded to a multiple of 16 elements so the memory-efficient SDPA kernel
    takes it as is (no per-call bool -> float conversion or alignment copy)."""
    idx = torch.arange(W, device=device)
    allowed = (idx[None, :] < ctx) | (idx[:, None] >= ctx)
    return bool_to_additive(allowed, dtype)


def bool_to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [T, T] (True = may attend) -> float [T, T] of 0 / -inf, rows padded in storage to 16 elements."""
    T = mask.shape[0]
    Tp = -(-T // 16) * 16
    out = torch.full((T, Tp), float("-inf"), device=mask.device, dtype=dtype)
    out[:, :T].masked_fill_(mask, 0.0)
    return out[:, :T]


@torch.no_grad()
def _conv_with_pointwise(conv: CausalConv1d, point: CausalConv1d) -> tuple[torch.Tensor, torch.Tensor]:
    """One implicit-GEMM weight [K * Cin, Cout + Cout'] and bias for a causal conv (kernel K) and a pointwise conv
    over the same input: the pointwise weight sits in the rows of the last tap (the current frame), zeros above."""
    k, cin = conv.kernel_size[0], conv.in_channels
    pw = torch.zeros(k * cin, point.out_channels, device=conv.weight.device, dtype=conv.weight.dtype)
    pw[(k - 1) * cin:] = point.weight[:, :, 0].t()
    return torch.cat([conv_weight_gemm(conv.weight), pw], dim=1), torch.cat([conv.bias, point.bias])


class CausalConditionalDecoder(nn.Module):
    """One down block, `est_mid_blocks` mid blocks and one up block (channels [256] in the real config)."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        c, tdim = cfg.est_channels, cfg.est_channels * 4
        self.in_channels = cfg.est_in_channels
        self.time_mlp = _TimeMLP(cfg.est_in_channels, tdim)

        def tblocks() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(c, cfg.est_heads, cfg.est_head_dim) for _ in range(cfg.est_n_blocks))

        self.down_blocks = nn.ModuleList([nn.ModuleList([CausalResnetBlock1D(cfg.est_in_channels, c, tdim), tblocks(),
                                                         CausalConv1d(c, c, 3)])])
        self.mid_blocks = nn.ModuleList(nn.ModuleList([CausalResnetBlock1D(c, c, tdim), tblocks()])
                                        for _ in range(cfg.est_mid_blocks))
        self.up_blocks = nn.ModuleList([nn.ModuleList([CausalResnetBlock1D(2 * c, c, tdim), tblocks(),
                                                       CausalConv1d(c, c, 3)])])
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = CausalConv1d(c, cfg.output_size, 1)
        self._fused_key: tuple | None = None
        self._tables: dict[tuple, torch.Tensor] = {}

    def _resnets(self) -> list[CausalResnetBlock1D]:
        return [self.down_blocks[0][0], *(m[0] for m in self.mid_blocks), self.up_blocks[0][0]]

    @torch.no_grad()
    def fuse(self) -> None:
        """Build the inference-only tensors derived from the weights (fused q/k/v). Call after loading or changing
        dtype/device; `forward`/`run` also rebuild them when they notice the weights changed."""
        key = weights_key(self)
        if key == self._fused_key:
            return
        for m in self.modules():
            if isinstance(m, _Attention):
                m.qkv_weight = torch.cat([m.to_q.weight, m.to_k.weight, m.to_v.weight]).detach()
            if isinstance(m, TransformerBlock):
                m.qkv_t = torch.cat([m.attn1.to_q.weight, m.attn1.to_k.weight, m.attn1.to_v.weight]).t().contiguous()
                m.ff1_t = m.ff.net[0].proj.weight.detach().t().contiguous()
            if isinstance(m, CausalConv1d):
                m.gemm_weight = conv_weight_gemm(m.weight.detach())
            if isinstance(m, CausalResnetBlock1D):
                m.conv1_res_gemm, m.conv1_res_bias = _conv_with_pointwise(m.block1.block[0], m.res_conv)
        self._tables.clear()
        self._fused_key = key

    def time_rows(self, t: torch.Tensor) -> torch.Tensor:
        """t [N] -> every resnet's time projection [n_resnets, N, C] (in the estimator dtype)."""
        dt = self.final_proj.weight.dtype
        temb = self.time_mlp(timestep_embedding(t, self.in_channels).to(dt))
        return torch.stack([r.mlp(temb) for r in self._resnets()])

    @torch.no_grad()
    def time_table(self, t_span: list[float], t_dtype: torch.dtype) -> torch.Tensor:
        """[steps, n_resnets, 1, C]: time_rows of each Euler step's start time t_span[s] (rounded to t_dtype, then to
        the estimator dtype, as a per-row t would be). Cached; rebuilt when the weights change."""
        self.fuse()
        key = (tuple(t_span[:-1]), t_dtype)
        tab = self._tables.get(key)
        if tab is None:
            dev = self.final_proj.weight.device
            t = torch.tensor(t_span[:-1], device=dev, dtype=t_dtype).to(self.final_proj.weight.dtype)
            tab = self.time_rows(t).transpose(0, 1)[:, :, None].contiguous()
            self._tables[key] = tab
        return tab

    @staticmethod
    def _attend(h: torch.Tensor, blocks: nn.ModuleList, mask: torch.Tensor, windows: int | None) -> torch.Tensor:
        """[B, C, T] through the transformer blocks -> [B, C, T]."""
        x, pending = h.transpose(1, 2), None
        for i, b in enumerate(blocks):
            x, pending = b(x, pending, mask, last=i == len(blocks) - 1, windows=windows)
        # Time-major [B, C, T] view of the last block's output: the next conv reads it without a copy.
        return x.transpose(1, 2)

    def run(self, h: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, windows: int | None = None
            ) -> torch.Tensor:
        """h [B, 320, T] = cat(x, mu, spks, cond) in the estimator dtype; rows [n_resnets, B|1, C] (`time_rows` or
        a `time_table` step); mask additive [T, T] (`window_mask`) -> velocity [B, 80, T]. windows: the windows of
        every call running side by side with this one (chains of one solve; default B), which picks kernels."""
        resnet, blocks, down = self.down_blocks[0]
        h = self._attend(resnet(h, rows[0]), blocks, mask, windows)
        skip = h
        h = down(h)
        for i, (resnet, blocks) in enumerate(self.mid_blocks):
            h = self._attend(resnet(h, rows[1 + i]), blocks, mask, windows)
        resnet, blocks, up = self.up_blocks[0]
        hs = torch.cat([h.transpose(1, 2), skip.transpose(1, 2)], dim=2).transpose(1, 2)  # time-major [B, 2C, T]
        h = self._attend(resnet(hs, rows[-1]), blocks, mask, windows)
        h = up(h)
        return self.final_proj(self.final_block(h))

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x, mu, cond [B, 80, T]; t [B]; spks [B, 80]; mask [T, T] bool (True = may attend) -> [B, 80, T]."""
        self.fuse()
        h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)
        return self.run(h, self.time_rows(t), bool_to_additive(mask, h.dtype))
