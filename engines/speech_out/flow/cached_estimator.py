"""The estimator over new chunks of frames, with everything earlier chunks contribute kept instead of recomputed.

Under the chunk-causal attention the chunk models were trained with, a frame attends to every frame of its own chunk
and of all earlier chunks, and each causal convolution (kernel 3) reads the two frames before it. So at one Euler step
a new chunk needs from the past exactly: each transformer block's keys and values of every earlier frame (the pages of
`EstimatorPages`) and each kernel-3 convolution's last two input frames (the "left" state). Given those, its outputs
equal those of the estimator run over the whole sequence under the chunk mask (tests/engines/speech_out/flow/
test_full_context.py), at O(chunk) compute per step.

Rows are a batch's conditional passes, then its unconditional ones (2B rows); the pages hold both, on their own axis.
Plain torch ops: the fused CUDA kernels of `estimator.py` take one fixed window without a cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.speech_out.flow.estimator import CausalConditionalDecoder, CausalConv1d, CausalResnetBlock1D


def kernel3_convs(est: CausalConditionalDecoder) -> list[CausalConv1d]:
    """The estimator's kernel-3 convolutions in the order a pass runs them (their left states are stored so)."""
    convs = []
    for r in est._resnets()[:1]:
        convs += [r.block1.block[0], r.block2.block[0]]
    convs.append(est.down_blocks[0][2])
    for r in est._resnets()[1:]:
        convs += [r.block1.block[0], r.block2.block[0]]
    convs += [est.up_blocks[0][2], est.final_block.block[0]]
    return convs


def left_channels(est: CausalConditionalDecoder) -> int:
    """Channels of the left state: the input channels of every kernel-3 convolution, side by side."""
    return sum(c.in_channels for c in kernel3_convs(est))


def n_blocks(est: CausalConditionalDecoder) -> int:
    return len(est.down_blocks[0][1]) + sum(len(m[1]) for m in est.mid_blocks) + len(est.up_blocks[0][1])


def paged_kernel(pool: torch.Tensor, head_dim: int) -> bool:
    """Whether attention reads the pages in place (engines/kernels/speech_out/flow/paged_attention.py: CUDA, half
    precision, a head_dim tensor cores take), else gathers them for SDPA (the reference path: CPU, float32)."""
    return pool.is_cuda and pool.dtype in (torch.bfloat16, torch.float16) and head_dim >= 16 \
        and head_dim & (head_dim - 1) == 0


class _Pass:
    """One pass of the estimator over a chunk: walks its layers, reading and writing the left states and pages."""

    def __init__(self, est: CausalConditionalDecoder, left: torch.Tensor, pool: torch.Tensor, table: torch.Tensor,
                 n_keys: torch.Tensor, new_page: torch.Tensor, n_new: torch.Tensor) -> None:
        self.est, self.left, self.pool, self.new_page = est, left, pool, new_page
        self.n_keys, self.n_new = n_keys, n_new
        self.new_left = torch.empty_like(left)
        self.off = 0  # channel offset of the next convolution's left state
        self.block = 0  # index of the next transformer block (its pages)
        B, maxp = table.shape
        c, fr = new_page.shape[1], pool.shape[4]
        self.frames = fr
        self.paged = paged_kernel(pool, est.down_blocks[0][1][0].attn1.dh)
        # Each block writes the chunks' keys and values to their pages first, then reads every page of the row (the
        # new ones last) in one gather: no second copy to append the chunks to what was read.
        self.table = torch.cat([table, new_page], dim=1)  # [B, maxp + c]
        # Which gathered keys a query may read: a row's earlier pages are all full (one page per whole chunk); of the
        # new pages, the real frames (a last chunk may be padded to a whole one) of the query's own chunk and those
        # before it. [2B, 1, 1 or F, (maxp + c) * frames]
        if self.paged:  # the kernel masks as it reads
            from engines.kernels.speech_out.flow.paged_attention import paged_attention

            self.paged_attention = paged_attention
            return
        i = torch.arange((maxp + c) * fr, device=table.device)
        j = i - maxp * fr  # position among the new pages' frames
        new = (j >= 0)[None] & (j[None] < n_new[:, None])  # [B, L]
        if c > 1:
            q_chunk = torch.arange(c * fr, device=table.device) // fr
            new = new[:, None, :] & ((j // fr)[None, None, :] <= q_chunk[None, :, None])  # [B, F, L]
        else:
            new = new[:, None, :]
        ok = (i[None] < n_keys[:, None])[:, None, :] | new
        self.mask = ok.repeat(2, 1, 1)[:, None]

    def conv(self, conv: CausalConv1d, x: torch.Tensor) -> torch.Tensor:
        """x [R, Cin, F] after its left state [R, Cin, 2] -> [R, Cout, F]; stores the new left state."""
        c = conv.in_channels
        full = torch.cat([self.left[:, self.off:self.off + c].to(x.dtype), x], dim=2)
        self.new_left[:, self.off:self.off + c] = full[:, :, -2:]
        self.off += c
        return F.conv1d(full, conv.weight, conv.bias)

    @staticmethod
    def norm_mish(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
        return F.mish(F.layer_norm(x.transpose(1, 2), norm.normalized_shape, norm.weight, norm.bias,
                                   norm.eps).transpose(1, 2))

    def resnet(self, r: CausalResnetBlock1D, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        h = self.norm_mish(self.conv(r.block1.block[0], x), r.block1.block[2]) + row[:, :, None]
        res = F.conv1d(x, r.res_conv.weight, r.res_conv.bias)
        return self.norm_mish(self.conv(r.block2.block[0], h), r.block2.block[2]) + res

    def attend(self, x: torch.Tensor, blocks) -> torch.Tensor:
        """x [R, C, F] through transformer blocks, each attending to its pages and the chunk itself."""
        y = x.transpose(1, 2)  # [R, F, C]
        for b in blocks:
            y = self.transformer(b, y)
        return y.transpose(1, 2)

    def transformer(self, blk, y: torch.Tensor) -> torch.Tensor:
        a = blk.attn1
        R, Fr, _ = y.shape
        B = R // 2
        h = F.layer_norm(y, blk.norm1.normalized_shape, blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
        q, k, v = F.linear(h, a.qkv_weight).view(R, Fr, 3, a.h * a.dh).unbind(2)  # each [R, F, D]
        j, self.block = self.block, self.block + 1
        pages = self.pool[j]  # [2 kv, 2 branch, pages, frames, D]
        c = self.new_page.shape[1]
        pages[:, :, self.new_page] = torch.stack([k, v]).view(2, 2, B, c, Fr // c, -1).to(pages.dtype)
        if self.paged:
            o = self.paged_attention(q, pages, self.table, self.n_keys, self.n_new, a.h, self.frames)  # [R, F, D]
            return self._feed_forward(blk, y + a.to_out[0](o))
        got = pages[:, :, self.table]  # [2 kv, 2 branch, B, maxp + c, frames, D]: one gather
        got = got.view(2, R, -1, got.shape[-1])  # [2 kv, R, L, D]: rows branch-major, as the chunk's
        keys, vals = got[0].to(q.dtype), got[1].to(q.dtype)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(R, t.shape[1], a.h, a.dh).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(q), heads(keys), heads(vals), attn_mask=self.mask)
        return self._feed_forward(blk, y + a.to_out[0](o.transpose(1, 2).reshape(R, Fr, a.h * a.dh)))

    @staticmethod
    def _feed_forward(blk, y: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(y, blk.norm3.normalized_shape, blk.norm3.weight, blk.norm3.bias, blk.norm3.eps)
        ff = blk.ff.net
        return y + ff[2](ff[0](h))


def estimate_chunk(est: CausalConditionalDecoder, h: torch.Tensor, rows: torch.Tensor, left: torch.Tensor,
                   pool: torch.Tensor, table: torch.Tensor, n_keys: torch.Tensor, new_page: torch.Tensor,
                   n_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The velocity of the new chunks' frames at one Euler step.
    h [2B, 320, F] = cat(x, mu, spks, cond) (conditional rows, then unconditional) in the estimator dtype;
    rows [n_resnets, 1|2B, C] the step's time rows; left [2B, left_channels, 2] the kernel-3 convolutions' last input
    frames before the chunk (zeros at the sequence start); pool: this step's pages [blocks, 2, 2, pages, frames, D];
    table [B, maxp] long the pages of each row's earlier chunks (padded), n_keys [B] long their frames; new_page
    [B, c] long the pages the c new chunks' keys and values are written to (F = c whole chunks of frames, each
    attending to itself and the ones before it); n_new [B] long the real frames among them (the rest of F is padding
    no real frame attends to; the causal convolutions keep it out of real frames anyway).
    Returns the velocity [2B, 80, F] and the new left state [2B, left_channels, 2]. The estimator's fused q/k/v
    must be built (`est.fuse()`; `est.time_table`, which gives the rows, builds it)."""
    p = _Pass(est, left, pool, table, n_keys, new_page, n_new)
    resnet, blocks, down = est.down_blocks[0]
    x = p.attend(p.resnet(resnet, h, rows[0]), blocks)
    skip = x
    x = p.conv(down, x)
    for i, (resnet, blocks) in enumerate(est.mid_blocks):
        x = p.attend(p.resnet(resnet, x, rows[1 + i]), blocks)
    resnet, blocks, up = est.up_blocks[0]
    x = p.attend(p.resnet(resnet, torch.cat([x, skip], dim=1), rows[-1]), blocks)
    x = p.conv(up, x)
    fb = est.final_block.block
    x = p.norm_mish(p.conv(fb[0], x), fb[2])
    return F.conv1d(x, est.final_proj.weight, est.final_proj.bias), p.new_left
