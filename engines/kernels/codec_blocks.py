"""The codec estimator's transformer block as two kernels at streaming sizes (GPU only).

At batch 1 a transformer block was five dependent kernels (engines/kernels/codec_fused.py: LayerNorm + q/k/v,
window attention, to_out, LayerNorm + ff.net.0 + GELU, ff.net.2), each ~3 us of which little is work: the chain
of kernel boundaries sets the Euler solve's time. Here each half of the block is one kernel. Its programs split
the GEMMs along their reduction (a head of to_out, a slice of the ff's inner width), store float32 partial sums,
and the last program to finish an output tile (an atomic counter per tile) adds them in a fixed order, so the
result does not depend on which program finished first:
- `attention_block`: s = x + pending; q/k/v of one head from LayerNorm(s); window attention; that head's share
  of to_out. Program (b, row block, head x column block).
- `ff_block`: s2 = s + attn; a slice of GELU(LayerNorm(s2) @ ff.net.0); that slice's share of ff.net.2 (+ s2 for
  the last block of a stack). Program (row block, slice, column block).
Rounding follows the torch path (float32 math, rounded to the activation dtype wherever torch stores a tensor);
only the float32 order inside the to_out and ff.net.2 sums differs from one GEMM's.

Counters: an int32 tensor, zero on entry; each tile's last program sets its counter back to zero, so one zeroed
tensor (`counters`) serves every block of an estimator call in stream order. A program touches counters and
activations only after the programmatic-launch wait (engines/kernels/pdl.py), when the kernel before it, and its
resets, have completed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engines.kernels.codec_fused import _gelu_f32, _launch
from engines.kernels.pdl import wait_then_trigger

# Rows (B x T) up to which the estimator takes these kernels, and the longest window (all of a window's frames are
# one tile of each program: its keys and values). Chosen from `python3 -m engines.bench.profile_codec --timeline`.
BLOCK_MAX_ROWS = 160
BLOCK_MAX_T = 64
ROWS = 16  # rows per program: the smallest tl.dot tile
ATTENTION = True  # False: the attention half as codec_fused's three kernels, only the ff half as one
# Tilings (columns of the output per program; the ff's inner slice; warps), set by the bench's sweep.
ATTN_COLS = 64
ATTN_WARPS = 8
FF_SLICE = 128
FF_COLS = 256
FF_WARPS = 8


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _layernorm_rows(x, w, b, C: tl.constexpr, eps):
    """LayerNorm over the last axis of a float32 [rows, C] tile; w, b [C] float32."""
    mean = tl.sum(x, 1) / C
    d = x - mean[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / C + eps)
    return d * rstd[:, None] * w[None, :] + b[None, :]


@triton.jit
def _load_sum(X, R, offs, m, HAS_RES: tl.constexpr, dt: tl.constexpr):
    """x (+ r, rounded to dt as torch's add stores it) as float32."""
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = (x + tl.load(R + offs, mask=m, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    return x


@triton.jit
def _reduce_last(P, CNT, tile, N_PARTS: tl.constexpr, part_idx, part, BLOCK_R: tl.constexpr, COLS: tl.constexpr):
    """Store this program's float32 partial [BLOCK_R, COLS] of `tile`; the last of its N_PARTS programs gets
    (True, the sum of all of them in part order), the others (False, their own partial)."""
    ro = tl.arange(0, BLOCK_R)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(P + (tile * N_PARTS + part_idx) * (BLOCK_R * COLS) + ro, part)
    tl.debug_barrier()  # every thread's stores precede the release below
    done = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
    acc = part
    last = done == N_PARTS - 1
    if last:
        acc = tl.zeros((BLOCK_R, COLS), tl.float32)
        for j in tl.static_range(N_PARTS):  # L2 reads (.cg): the partials were written by other SMs
            acc += tl.load(P + (tile * N_PARTS + j) * (BLOCK_R * COLS) + ro, cache_modifier=".cg")
        tl.store(CNT + tile, 0)  # ready for the next kernel that uses the counters
    return last, acc


@triton.jit(do_not_specialize=["T", "s_mb"])
def _attention_block_kernel(X, R, LNW, LNB, WQKV, WO, BO, MASK, S, P, CNT, OUT, T, s_mb, s_mt, eps, scale,
                            C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_R: tl.constexpr, COLS: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr,
                            PDL: tl.constexpr):
    b = tl.program_id(0)
    rb = tl.program_id(1)
    h = tl.program_id(2) % H
    cb = tl.program_id(2) // H
    HD: tl.constexpr = H * D
    rc = tl.arange(0, C)
    rd = tl.arange(0, D)
    rn = cb * COLS + tl.arange(0, COLS)
    # Weights before the wait (nothing in a solve writes them): this head's rows of to_out for these columns.
    lnw = tl.load(LNW + rc).to(tl.float32)
    lnb = tl.load(LNB + rc).to(tl.float32)
    wo = tl.load(WO + rn[None, :] * HD + (h * D + rd)[:, None])  # [D, COLS]
    bo = tl.load(BO + rn).to(tl.float32)
    wait_then_trigger(PDL)
    dt = OUT.dtype.element_ty
    # Keys and values need every frame of the window: each program computes its head's from all T rows.
    rt = tl.arange(0, BLOCK_T)
    tm = rt < T
    xa = _load_sum(X, R, b * T * C + rt[:, None] * C + rc[None, :], tm[:, None], HAS_RES, dt)  # [BLOCK_T, C]
    if HAS_RES:
        if (rb == 0) & (tl.program_id(2) == 0):  # one program stores the residual stream
            tl.store(S + b * T * C + rt[:, None] * C + rc[None, :], xa.to(dt), mask=tm[:, None])
    ha = _layernorm_rows(xa, lnw, lnb, C, eps).to(dt)
    wcol = rc[:, None] * (3 * HD) + h * D + rd[None, :]  # [C, D] of q; k and v are HD and 2 HD further
    k = _dot(ha, tl.load(WQKV + wcol + HD), IEEE).to(dt)  # [BLOCK_T, D]
    v = _dot(ha, tl.load(WQKV + wcol + 2 * HD), IEEE).to(dt)
    # This program's query rows (their LayerNorm again: a register tile cannot be sliced by rows).
    rr = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = rr < T
    xr = _load_sum(X, R, b * T * C + rr[:, None] * C + rc[None, :], rm[:, None], HAS_RES, dt)
    q = _dot(_layernorm_rows(xr, lnw, lnb, C, eps).to(dt), tl.load(WQKV + wcol), IEEE).to(dt)  # [BLOCK_R, D]
    sc = _dot(q, tl.trans(k), IEEE) * scale
    sc += tl.load(MASK + b * s_mb + rr[:, None] * s_mt + rt[None, :], mask=rm[:, None] & tm[None, :],
                  other=float("-inf")).to(tl.float32)
    mx = tl.max(sc, 1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a fully masked (padding) row gives zeros, not NaN
    p = tl.exp(sc - mx[:, None])
    den = tl.sum(p, 1)
    p = p / tl.where(den == 0.0, 1.0, den)[:, None]
    if IEEE:
        o = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        o = tl.dot(p.to(dt), v)
    o = o.to(dt)  # the attention output, stored rounded by torch
    tile = (b * tl.num_programs(1) + rb) * (C // COLS) + cb
    last, acc = _reduce_last(P, CNT, tile, H, h, _dot(o, wo, IEEE), BLOCK_R, COLS)
    if last:
        tl.store(OUT + b * T * C + rr[:, None] * C + rn[None, :], (acc + bo[None, :]).to(dt), mask=rm[:, None])


@triton.jit(do_not_specialize=["M"])
def _ff_block_kernel(X, R, LNW, LNB, W1, B1, W2, B2, S, P, CNT, Y, M, eps, C: tl.constexpr, F: tl.constexpr,
                     BLOCK_M: tl.constexpr, SLICE: tl.constexpr, COLS: tl.constexpr, HAS_RES: tl.constexpr,
                     LAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    rb = tl.program_id(0)
    j = tl.program_id(1)
    cb = tl.program_id(2)
    rc = tl.arange(0, C)
    rs = j * SLICE + tl.arange(0, SLICE)
    rn = cb * COLS + tl.arange(0, COLS)
    lnw = tl.load(LNW + rc).to(tl.float32)
    lnb = tl.load(LNB + rc).to(tl.float32)
    w1 = tl.load(W1 + rc[:, None] * F + rs[None, :])  # [C, SLICE] of ff.net.0 (transposed)
    b1 = tl.load(B1 + rs).to(tl.float32)
    w2 = tl.load(W2 + rn[None, :] * F + rs[:, None])  # [SLICE, COLS] of ff.net.2
    b2 = tl.load(B2 + rn).to(tl.float32)
    wait_then_trigger(PDL)
    dt = Y.dtype.element_ty
    rm = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rm < M
    x = _load_sum(X, R, rm[:, None] * C + rc[None, :], mm[:, None], HAS_RES, dt)  # [BLOCK_M, C]
    if HAS_RES:
        if (j == 0) & (cb == 0):
            tl.store(S + rm[:, None] * C + rc[None, :], x.to(dt), mask=mm[:, None])
    a = (_dot(_layernorm_rows(x, lnw, lnb, C, eps).to(dt), w1, IEEE) + b1[None, :]).to(dt)
    a = _gelu_f32(a.to(tl.float32)).to(dt)  # [BLOCK_M, SLICE]
    last, acc = _reduce_last(P, CNT, rb * (C // COLS) + cb, F // SLICE, j, _dot(a, w2, IEEE), BLOCK_M, COLS)
    if last:
        y = (acc + b2[None, :]).to(dt)
        om = rm[:, None] * C + rn[None, :]
        if LAST:  # the stack's output: the ff output rounded, then the residual add rounded
            y = (y.to(tl.float32) + _load_sum(X, R, om, mm[:, None], HAS_RES, dt)).to(dt)
        tl.store(Y + om, y, mask=mm[:, None])


def usable(rows: int, t: int, c: int, heads: int, head_dim: int, inner: int) -> bool:
    """Whether a block of these sizes takes the two kernels: streaming row counts, a short window, power-of-two
    widths that the tilings divide."""
    def pow2(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0
    return 0 < rows <= BLOCK_MAX_ROWS and t <= BLOCK_MAX_T and pow2(c) and pow2(head_dim) and pow2(inner)


def _tiles(c: int, inner: int) -> tuple[int, int, int]:
    """(attention's output columns, ff's inner slice, ff's output columns) per program, for widths narrower than
    the tilings too (powers of two, so they divide)."""
    return min(ATTN_COLS, c), min(FF_SLICE, inner), min(FF_COLS, c)


def counters(batch: int, t: int, c: int, device: torch.device) -> torch.Tensor:
    """A zeroed counter tensor large enough for either kernel at this size (reused by every block of a call)."""
    attn_cols, _, ff_cols = _tiles(c, c)
    n_attn = batch * triton.cdiv(t, ROWS) * (c // attn_cols)
    n_ff = triton.cdiv(batch * t, ROWS) * (c // ff_cols)
    return torch.zeros(max(n_attn, n_ff), device=device, dtype=torch.int32)


def attention_block(x: torch.Tensor, pending: torch.Tensor | None, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                    eps: float, qkv_t: torch.Tensor, out_weight: torch.Tensor, out_bias: torch.Tensor,
                    mask: torch.Tensor, heads: int, head_dim: int, cnt: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_out(attention(LayerNorm(s))) [B, T, C], s [B, T, C]) for s = x + pending (x itself when pending is None).
    x, pending [B, T, C]; qkv_t [C, 3 * heads * head_dim] (q | k | v, transposed); out_weight [C, heads * head_dim];
    mask additive [T, T] or [B, T, T] with dense rows; cnt from `counters`."""
    nb, t, c = x.shape
    hd = heads * head_dim
    if qkv_t.shape != (c, 3 * hd) or out_weight.shape != (c, hd) or mask.stride(-1) != 1:
        raise ValueError(f"attention_block: q/k/v {tuple(qkv_t.shape)} / to_out {tuple(out_weight.shape)} do not fit "
                         f"{c} channels x {heads} heads x {head_dim}, or the mask rows are not dense")
    x = x if x.is_contiguous() else x.contiguous()
    s = x
    if pending is not None:
        pending = pending if pending.is_contiguous() else pending.contiguous()
        s = torch.empty_like(x)
    out = torch.empty_like(x)
    cols = _tiles(c, c)[0]
    n_rb, n_cb = triton.cdiv(t, ROWS), c // cols
    part = torch.empty(nb * n_rb * n_cb * heads * ROWS * cols, device=x.device, dtype=torch.float32)
    _attention_block_kernel[(nb, n_rb, heads * n_cb)](
        x, pending if pending is not None else x, ln_weight, ln_bias, qkv_t, out_weight, out_bias, mask, s, part,
        cnt, out, t, mask.stride(0) if mask.dim() == 3 else 0, mask.stride(-2), eps, head_dim ** -0.5, C=c, H=heads,
        D=head_dim, BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_R=ROWS, COLS=cols,
        HAS_RES=pending is not None, IEEE=x.dtype == torch.float32, num_warps=ATTN_WARPS, num_stages=1,
        **_launch(x.device, nb * t))
    return out, s


def ff_block(s: torch.Tensor, attn: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
             ff1_t: torch.Tensor, ff1_bias: torch.Tensor, ff2_weight: torch.Tensor, ff2_bias: torch.Tensor,
             last: bool, cnt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """s2 = s + attn, ff = ff.net.2(GELU(ff.net.0(LayerNorm(s2)))); returns (s2, ff), or (s2 + ff, None) when
    `last`, the pair TransformerBlock.forward returns. s, attn [B, T, C]; ff1_t [C, F]; ff2_weight [C, F]."""
    nb, t, c = s.shape
    inner = ff1_t.shape[1]
    if ff1_t.shape[0] != c or ff2_weight.shape != (c, inner):
        raise ValueError(f"ff_block: ff weights {tuple(ff1_t.shape)} / {tuple(ff2_weight.shape)} do not fit {c} "
                         "channels")
    s = s if s.is_contiguous() else s.contiguous()
    attn = attn if attn.is_contiguous() else attn.contiguous()
    s2 = torch.empty_like(s)
    y = torch.empty_like(s)
    m = nb * t
    _, slice_, cols = _tiles(c, inner)
    n_rb, n_j, n_cb = triton.cdiv(m, ROWS), inner // slice_, c // cols
    part = torch.empty(n_rb * n_cb * n_j * ROWS * cols, device=s.device, dtype=torch.float32)
    _ff_block_kernel[(n_rb, n_j, n_cb)](
        s, attn, ln_weight, ln_bias, ff1_t, ff1_bias, ff2_weight, ff2_bias, s2, part, cnt, y, m, eps, C=c, F=inner,
        BLOCK_M=ROWS, SLICE=slice_, COLS=cols, HAS_RES=True, LAST=last, IEEE=s.dtype == torch.float32,
        num_warps=FF_WARPS, num_stages=1, **_launch(s.device, m))
    return (y, None) if last else (s2, y)
