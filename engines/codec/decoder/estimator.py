"""Causal conditional CFM estimator: predicts the flow velocity for mel frames given x_t, mu, speaker, cond, t.

Key layout of the checkpoint (`decoder.estimator.` prefix in flow.pt): `time_mlp.linear_{1,2}`,
`down_blocks.0.{0: resnet, 1.N: transformer, 2: causal conv}`, `mid_blocks.M.{0: resnet, 1.N: transformer}`,
`up_blocks.0.{0,1.N,2}`, `final_block.block.{0: conv, 2: layer norm}`, `final_proj`. A resnet is
`block1/block2.block.{0: causal conv k3, 2: LayerNorm}`, `mlp.1` (time projection), `res_conv`; a transformer
block is `norm1`, `attn1.to_{q,k,v}`, `attn1.to_out.0`, `norm3`, `ff.net.0.proj`, `ff.net.2`.
The estimator always sees a fixed window (context frames + current chunk), so it needs no cache of its own:
the context frames' x_t trajectories are kept by the flow.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engines.codec.decoder.config import FlowConfig


class CausalConv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # Indices match the checkpoint: 0 conv, 2 LayerNorm (1 and 3 are transposes, 4 Mish).
        self.block = nn.Sequential(CausalConv1d(dim, dim_out, 3), _Transpose(), nn.LayerNorm(dim_out), _Transpose(),
                                   nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.block1(x) + self.mlp(t)[:, :, None]
        return self.block2(h) + self.res_conv(x)


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, self.h, self.dh).transpose(1, 2) for m in (self.to_q, self.to_k, self.to_v))
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), mask)
        h = self.norm3(x)
        for m in self.ff.net:
            h = m(h)
        return x + h


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
        self.final_proj = nn.Conv1d(c, cfg.output_size, 1)

    @staticmethod
    def _attend(x: torch.Tensor, blocks: nn.ModuleList, mask: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        for b in blocks:
            x = b(x, mask)
        return x.transpose(1, 2)

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x, mu, cond [B, 80, T]; t [B]; spks [B, 80]; mask [T, T] bool (True = may attend) -> [B, 80, T]."""
        temb = self.time_mlp(timestep_embedding(t, self.in_channels).to(x.dtype))
        h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)
        resnet, blocks, down = self.down_blocks[0]
        h = self._attend(resnet(h, temb), blocks, mask)
        skip = h
        h = down(h)
        for resnet, blocks in self.mid_blocks:
            h = self._attend(resnet(h, temb), blocks, mask)
        resnet, blocks, up = self.up_blocks[0]
        h = self._attend(resnet(torch.cat([h, skip], dim=1), temb), blocks, mask)
        h = up(h)
        return self.final_proj(self.final_block(h))
