"""The estimator over new chunks of frames, with everything earlier chunks contribute kept instead of recomputed.

Under the chunk-causal attention the chunk models were trained with, a frame attends to every frame of its own chunk
and of all earlier chunks, and each causal convolution (kernel 3) reads the two frames before it. So at one Euler step
a new chunk needs from the past exactly: each transformer block's keys and values of every earlier frame (the pages of
`EstimatorPages`) and each kernel-3 convolution's last two input frames (the "left" state). Given those, its outputs
equal those of the estimator run over the whole sequence under the chunk mask (tests/engines/speech_out/flow/
test_full_context.py), at O(chunk) compute per step.

Rows are a batch's conditional passes, then its unconditional ones (2B rows); the pages hold both, on their own axis.
A pass runs the estimator's own layers and kernels (`estimator.py`: on CUDA the causal convolutions as implicit
GEMMs and LayerNorm tails fused, time-major activations), each convolution fed its left state in front of the chunk.
On CUDA in half precision a transformer block is the windowed flow's fused kernels around an attention that reads
the pages in place (engines/kernels/speech_out/flow/paged_attention.py); elsewhere (the reference: CPU, float32)
attention gathers the pages for SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.config import cache_views
from engines.speech_out.flow.estimator import (
    CausalConditionalDecoder,
    CausalConv1d,
    CausalResnetBlock1D,
    layernorm_mish,
)


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


def paged_kernel(pool: torch.Tensor, est: CausalConditionalDecoder) -> bool:
    """Whether a pass runs the fused transformer blocks with attention reading the pages in place: CUDA, the
    estimator in half precision and its pages in that dtype or fp8, widths the kernels take (powers of two >= 16),
    the fused weights built (`est.fuse`)."""
    blk = est.down_blocks[0][1][0]
    d, dh = blk.norm1.normalized_shape[0], blk.attn1.dh
    dt = est.final_proj.weight.dtype
    return (pool.is_cuda and dt in (torch.bfloat16, torch.float16) and pool.dtype in (dt, torch.float8_e4m3fn)
            and blk.qkv_t is not None and all(n >= 16 and n & (n - 1) == 0 for n in (d, dh)))


class _Pass:
    """One pass of the estimator over new chunks: walks its layers, reading and writing the left states and pages."""

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
        self.paged = paged_kernel(pool, est)
        # Each block writes the chunks' keys and values to their pages first, then reads every page of the row (the
        # new ones last): no second copy to append the chunks to what was read.
        self.table = torch.cat([table, new_page], dim=1)  # [B, maxp + c]
        if self.paged:  # the kernel masks as it reads
            from engines.kernels.speech_out.flow.paged_attention import paged_attention, write_pages

            self.paged_attention, self.write_pages = paged_attention, write_pages
            return
        # Which gathered keys a query may read: a row's earlier pages are all full (one page per whole chunk); of the
        # new pages, the real frames (a last chunk may be padded to a whole one) of the query's own chunk and those
        # before it. [2B, 1, 1 or F, (maxp + c) * frames]
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

    def with_left(self, conv: CausalConv1d, x: torch.Tensor) -> torch.Tensor:
        """x [R, Cin, F] after its left state -> [R, Cin, F + 2]; stores the new left state."""
        c = conv.in_channels
        full = torch.cat([self.left[:, self.off:self.off + c].to(x.dtype), x], dim=2)
        self.new_left[:, self.off:self.off + c] = full[:, :, -2:]
        self.off += c
        return full

    def conv(self, conv: CausalConv1d, x: torch.Tensor) -> torch.Tensor:
        """x [R, Cin, F] after its left state -> [R, Cout, F] (a kernel-3 causal conv; its first two outputs, which
        would read before the left state, are dropped)."""
        return conv(self.with_left(conv, x))[:, :, 2:]

    def resnet(self, r: CausalResnetBlock1D, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and r.conv1_res_gemm is not None:  # block1's conv and res_conv as one conv (estimator.py)
            from engines.kernels.speech_out.flow.conv import causal_conv

            c = r.conv1_res_bias.shape[0] // 2
            both = causal_conv(self.with_left(r.block1.block[0], x), r.conv1_res_gemm, r.conv1_res_bias, 3)[:, :, 2:]
            h, res = both[:, :c], both[:, c:]
        else:
            h, res = self.conv(r.block1.block[0], x), r.res_conv(x)
        h = layernorm_mish(h, r.block1.block[2], row=row)
        return layernorm_mish(self.conv(r.block2.block[0], h), r.block2.block[2], residual=res)

    def attend(self, x: torch.Tensor, blocks) -> torch.Tensor:
        """x [R, C, F] through transformer blocks, each attending to its pages and the chunks themselves; each
        block's residual add runs with the next one's LayerNorm, as `CausalConditionalDecoder._attend`."""
        y, pending = x.transpose(1, 2), None  # [R, F, C]
        for i, b in enumerate(blocks):
            y, pending = self.transformer(b, y, pending, last=i == len(blocks) - 1)
        return y.transpose(1, 2)

    def transformer(self, blk, y: torch.Tensor, pending: torch.Tensor | None, last: bool):
        """The block over y + pending; returns (y, ff_out) whose sum is its output ((output, None) for the last)."""
        a = blk.attn1
        if self.paged:
            from engines.kernels.speech_out.flow import gemm

            qkv, y = gemm.ln_linear(y, pending, blk.norm1.weight, blk.norm1.bias, blk.norm1.eps, blk.qkv_t)
            return blk.after_attention(y, self.attention(qkv, a.h), last)
        return blk.around(y, pending, lambda h: a.to_out[0](self.attention(F.linear(h, a.qkv_weight), a.h)), last)

    def attention(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """qkv [R, F, 3D] of the new chunks -> their attention output [R, F, D] over the row's pages and themselves;
        their keys and values are written to their pages first."""
        R, Fr, D3 = qkv.shape
        B, D, c = R // 2, D3 // 3, self.new_page.shape[1]
        j, self.block = self.block, self.block + 1
        pages = self.pool[j]  # [2 kv, 2 branch, pages, frames, D]
        q = qkv[:, :, :D]
        if self.paged:
            self.write_pages(qkv, pages, self.new_page)
            return self.paged_attention(q, pages, self.table, self.n_keys, self.n_new, heads, self.frames)
        # [2 kv, 2 branch, B, c, frames, D]: views of qkv, written in one indexed copy
        kv = qkv.unflatten(2, (3, D))[:, :, 1:].permute(2, 0, 1, 3).unflatten(1, (2, B)).unflatten(3, (c, Fr // c))
        kv, store = cache_views(kv, pages)
        store[:, :, self.new_page] = kv
        got = store[:, :, self.table].view(pages.dtype)  # [2 kv, 2 branch, B, maxp + c, frames, D]: one gather
        got = got.view(2, R, -1, got.shape[-1])  # [2 kv, R, L, D]: rows branch-major, as the chunk's
        keys, vals = got[0].to(q.dtype), got[1].to(q.dtype)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(R, t.shape[1], heads, D // heads).transpose(1, 2)

        o = F.scaled_dot_product_attention(split(q), split(keys), split(vals), attn_mask=self.mask)
        return o.transpose(1, 2).reshape(R, Fr, D)


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
    return est.final_proj(layernorm_mish(p.conv(fb[0], x), fb[2])), p.new_left
