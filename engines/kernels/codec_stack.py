"""Experiment: a stack of the codec estimator's transformer blocks as one persistent kernel (GPU only).

At batch 1 a transformer block is five dependent kernels (engines/kernels/codec_fused.py), ~3 us each, and the
Euler solve is 10 x 56 such blocks plus the resnets. Fusing a block's stages into fewer kernels made programs do
more serial work and measured slower (docs/PERF_NOTES.md, session 9). Here the tiling stays the same - every work
item is one small dot, as one program of today's kernels does - and only the kernel boundaries go: one launch
runs every item of a stack's blocks, and an item waits on counters for the items it reads instead of on the end of
the kernel before.

Work items, per block (rows in blocks of ROWS, columns in blocks of each stage's COLS):
  A  qkv[rows, cols] = LayerNorm1(s) @ Wqkv                  after E of the block before, same rows
  B  o[batch b, head h] = window attention of b's rows     after A of every row block of b
  C  s_mid[rows, cols] = s + o @ Wout^T + bias               after B of every batch row in these rows
  D  h1[rows, cols] = GELU(LayerNorm3(s_mid) @ W1 + b1)      after C, same rows
  E  s_next[rows, cols] = s_mid + h1 @ W2^T + b2             after D, same rows
Items are numbered in that order, block after block, and programs take the next number from an atomic ticket.
Every item an item waits for has a smaller number, already taken by a running program, so the kernel cannot
deadlock however many programs are resident, and under Triton's interpreter (programs one after the other) the
first program runs every item in order and never waits.

Publication: a program stores its tile, synchronises its threads, then adds one to the stage counter with
release semantics; a reader acquires the counter and reads activations through L2 (`.cg`). Each block has its
own buffers, so nothing is overwritten while it may be read. Rounding follows the torch path of
TransformerBlock (float32 math, rounded to the activation dtype wherever torch stores a tensor).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engines.kernels.codec_fused import _gelu_f32, softmax_pv

# Off unless MOSS_CODEC_STACK=1 (or set by engines.bench.profile_codec --timeline): not yet measured on a GPU.
# Read by CausalConditionalDecoder.fuse, which then keeps a stacked copy of every stack's weights.
ENABLED = os.environ.get("MOSS_CODEC_STACK", "0") == "1"

ROWS = 16  # rows per item: the smallest tl.dot tile (the kernel's tiles and row-block counters are written for 16)
TILE = 16384  # elements of one item's weight tile (32 KB of bf16), as codec_fused.LINEAR_TILE
STACK_MAX_T = 64  # a batch row's window is one tile of keys and values
STACK_MAX_ROWS = 160  # two sessions' CFG windows
# Warps and programs per SM. Compiled offline for sm_90 (bf16, width 256): 255 registers at 4 warps with a
# 1000-byte spill stack, 600 bytes at 8 warps (the served ff.net.2 kernel alone: 255 registers, 40 bytes).
# Untimed: engines.bench.profile_codec --timeline tries the combinations.
WARPS = 8
PROGRAMS_PER_SM = 1


@dataclass(frozen=True)
class StackWeights:
    """A stack's blocks' weights, stacked on a leading block axis (built once per load by `stack_weights`)."""

    ln1_w: torch.Tensor  # [NB, C]
    ln1_b: torch.Tensor  # [NB, C]
    wqkv: torch.Tensor  # [NB, C, 3 HD]: q | k | v, each head-major (TransformerBlock.qkv_t)
    wo: torch.Tensor  # [NB, C, HD]: to_out.0.weight
    bo: torch.Tensor  # [NB, C]
    ln3_w: torch.Tensor  # [NB, C]
    ln3_b: torch.Tensor  # [NB, C]
    w1: torch.Tensor  # [NB, C, 4C]: ff.net.0.proj.weight transposed (TransformerBlock.ff1_t)
    b1: torch.Tensor  # [NB, 4C]
    w2: torch.Tensor  # [NB, C, 4C]: ff.net.2.weight
    b2: torch.Tensor  # [NB, C]
    eps: float
    heads: int
    head_dim: int


def stack_weights(blocks) -> StackWeights:  # noqa: ANN001 - a ModuleList of estimator.TransformerBlock, fused
    """StackWeights of fused TransformerBlocks (their qkv_t / ff1_t built)."""
    eps = {b.norm1.eps for b in blocks} | {b.norm3.eps for b in blocks}
    if len(eps) != 1:
        raise ValueError(f"the stack's LayerNorms differ in eps: {sorted(eps)}")

    def st(get) -> torch.Tensor:  # noqa: ANN001
        return torch.stack([get(b).detach() for b in blocks]).contiguous()

    a = blocks[0].attn1
    return StackWeights(
        ln1_w=st(lambda b: b.norm1.weight), ln1_b=st(lambda b: b.norm1.bias), wqkv=st(lambda b: b.qkv_t),
        wo=st(lambda b: b.attn1.to_out[0].weight), bo=st(lambda b: b.attn1.to_out[0].bias),
        ln3_w=st(lambda b: b.norm3.weight), ln3_b=st(lambda b: b.norm3.bias), w1=st(lambda b: b.ff1_t),
        b1=st(lambda b: b.ff.net[0].proj.bias), w2=st(lambda b: b.ff.net[2].weight), b2=st(lambda b: b.ff.net[2].bias),
        eps=eps.pop(), heads=a.h, head_dim=a.dh)


def stack_fits(w: StackWeights, batch: int, t: int) -> bool:
    """Whether `transformer_stack` takes this call: power-of-two widths and a short window at streaming rows."""
    c, hd, d = w.wqkv.shape[1], w.heads * w.head_dim, w.head_dim

    def p2(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return p2(c) and p2(d) and p2(hd) and t <= STACK_MAX_T and 0 < batch * t <= STACK_MAX_ROWS


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _wait(ptr, need):
    """Spin until the counter at ptr reaches need (acquire: what its writers stored is then visible)."""
    while tl.atomic_add(ptr, 0, sem="acquire", scope="gpu") < need:
        pass


@triton.jit
def _publish(ptr):
    tl.debug_barrier()  # every thread's stores precede the release below
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _layernorm(x, w, b, C: tl.constexpr, eps):
    """LayerNorm of a float32 [rows, C] tile; w, b [C] float32."""
    mean = tl.sum(x, 1) / C
    d = x - mean[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / C + eps)
    return d * rstd[:, None] * w[None, :] + b[None, :]


# One function per stage: Triton requires a name assigned in both arms of an if to have one type, and the stages'
# tiles differ, so each stage's locals live in its own (inlined) function.


@triton.jit
def _stage_qkv(SRC, wait_ptr, wait_need, LNW, LNB, WQKV, QKV, done_ptr, rb, cb, M, eps, C: tl.constexpr,
               N: tl.constexpr, COLS: tl.constexpr, IEEE: tl.constexpr):
    """A: qkv[rows, cols] = LayerNorm1(src[rows]) @ Wqkv[:, cols]; waits for the previous block's E (wait_need > 0)."""
    rc = tl.arange(0, C)
    rn = cb * COLS + tl.arange(0, COLS)
    lnw = tl.load(LNW + rc).to(tl.float32)
    lnb = tl.load(LNB + rc).to(tl.float32)
    w = tl.load(WQKV + rc[:, None] * N + rn[None, :])  # [C, COLS]
    rows = rb * 16 + tl.arange(0, 16)
    rm = rows < M
    if wait_need > 0:
        _wait(wait_ptr, wait_need)
    x = tl.load(SRC + rows[:, None] * C + rc[None, :], mask=rm[:, None], other=0.0, cache_modifier=".cg")
    h = _layernorm(x.to(tl.float32), lnw, lnb, C, eps).to(QKV.dtype.element_ty)
    tl.store(QKV + rows[:, None] * N + rn[None, :], _dot(h, w, IEEE).to(QKV.dtype.element_ty), mask=rm[:, None])
    _publish(done_ptr)


@triton.jit
def _stage_attention(QKV, MASK, ATT, cnt_a, need_a, done_ptr, b, hh, T, s_mt, scale, H: tl.constexpr,
                     D: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr):
    """B: window attention of batch row b, head hh; waits for A of every row block holding b's rows."""
    HD: tl.constexpr = H * D
    dt = ATT.dtype.element_ty
    rt = tl.arange(0, BLOCK_T)
    tm = rt < T
    for rb in range((b * T) // 16, (b * T + T - 1) // 16 + 1):
        _wait(cnt_a + rb, need_a)
    rd = tl.arange(0, D)
    base = QKV + (b * T + rt)[:, None] * (3 * HD) + hh * D + rd[None, :]
    q = tl.load(base, mask=tm[:, None], other=0.0, cache_modifier=".cg")
    k = tl.load(base + HD, mask=tm[:, None], other=0.0, cache_modifier=".cg")
    v = tl.load(base + 2 * HD, mask=tm[:, None], other=0.0, cache_modifier=".cg")
    sc = _dot(q, tl.trans(k), IEEE) * scale
    # The mask only now, as the served kernel loads it: held across the wait, its [T, T] float32 tile spilled.
    am = tl.load(MASK + rt[:, None] * s_mt + rt[None, :], mask=tm[:, None] & tm[None, :],
                 other=float("-inf")).to(tl.float32)
    o = softmax_pv(sc + am, v, IEEE)
    tl.store(ATT + (b * T + rt)[:, None] * HD + hh * D + rd[None, :], o.to(dt), mask=tm[:, None])
    _publish(done_ptr)


@triton.jit
def _weight_cols(W, rn, K: tl.constexpr):
    """Columns rn of a Linear weight W [N, K] as a [K, COLS] dot operand. Loaded as its rows (contiguous along K)
    and transposed in registers: the strided [K, COLS] load compiled to 32 registers and a 2.6 KB spill stack."""
    return tl.trans(tl.load(W + rn[:, None] * K + tl.arange(0, K)[None, :]))


@triton.jit
def _linear_residual(A, w, bias, RES, OUT, rows, rm, rn, K: tl.constexpr, C: tl.constexpr, IEEE: tl.constexpr):
    """out[rows, rn] = res + (a[rows] @ w + bias), rounded as torch does: the Linear's output, then the sum."""
    dt = OUT.dtype.element_ty
    rk = tl.arange(0, K)
    a = tl.load(A + rows[:, None] * K + rk[None, :], mask=rm[:, None], other=0.0, cache_modifier=".cg")
    y = (_dot(a, w, IEEE) + bias[None, :]).to(dt)
    res = tl.load(RES + rows[:, None] * C + rn[None, :], mask=rm[:, None], other=0.0, cache_modifier=".cg")
    tl.store(OUT + rows[:, None] * C + rn[None, :], (y.to(tl.float32) + res.to(tl.float32)).to(dt),
             mask=rm[:, None])


@triton.jit
def _stage_out(ATT, WO, BO, RES, SMID, cnt_b, need_b, done_ptr, rb, cb, T, M, C: tl.constexpr, HD: tl.constexpr,
               COLS: tl.constexpr, IEEE: tl.constexpr):
    """C: smid[rows, cols] = res + (att[rows] @ Wout[cols]^T + bias); waits for B of every batch row in rows."""
    rn = cb * COLS + tl.arange(0, COLS)
    w = _weight_cols(WO, rn, HD)  # [HD, COLS]
    bias = tl.load(BO + rn).to(tl.float32)
    rows = rb * 16 + tl.arange(0, 16)
    for b in range((rb * 16) // T, tl.minimum(rb * 16 + 15, M - 1) // T + 1):
        _wait(cnt_b + b, need_b)
    _linear_residual(ATT, w, bias, RES, SMID, rows, rows < M, rn, HD, C, IEEE)
    _publish(done_ptr)


@triton.jit
def _stage_ff1(SMID, LNW, LNB, W1, B1, H1, wait_ptr, wait_need, done_ptr, rb, cb, M, eps, C: tl.constexpr,
               COLS: tl.constexpr, IEEE: tl.constexpr):
    """D: h1[rows, cols] = GELU(LayerNorm3(smid[rows]) @ W1[:, cols] + b1); waits for C of these rows."""
    F: tl.constexpr = 4 * C
    dt = H1.dtype.element_ty
    rc = tl.arange(0, C)
    rn = cb * COLS + tl.arange(0, COLS)
    lnw = tl.load(LNW + rc).to(tl.float32)
    lnb = tl.load(LNB + rc).to(tl.float32)
    w = tl.load(W1 + rc[:, None] * F + rn[None, :])  # [C, COLS]
    bias = tl.load(B1 + rn).to(tl.float32)
    rows = rb * 16 + tl.arange(0, 16)
    rm = rows < M
    _wait(wait_ptr, wait_need)
    x = tl.load(SMID + rows[:, None] * C + rc[None, :], mask=rm[:, None], other=0.0, cache_modifier=".cg")
    h = _layernorm(x.to(tl.float32), lnw, lnb, C, eps).to(dt)
    y = (_dot(h, w, IEEE) + bias[None, :]).to(dt)
    tl.store(H1 + rows[:, None] * F + rn[None, :], _gelu_f32(y.to(tl.float32)).to(dt), mask=rm[:, None])
    _publish(done_ptr)


@triton.jit
def _stage_ff2(H1, W2, B2, SMID, OUT, wait_ptr, wait_need, done_ptr, rb, cb, M, C: tl.constexpr,
               COLS: tl.constexpr, IEEE: tl.constexpr):
    """E: out[rows, cols] = smid + (h1[rows] @ W2[cols]^T + b2); waits for D of these rows."""
    rn = cb * COLS + tl.arange(0, COLS)
    w = _weight_cols(W2, rn, 4 * C)  # [4C, COLS]
    bias = tl.load(B2 + rn).to(tl.float32)
    rows = rb * 16 + tl.arange(0, 16)
    _wait(wait_ptr, wait_need)
    _linear_residual(H1, w, bias, SMID, OUT, rows, rows < M, rn, 4 * C, C, IEEE)
    _publish(done_ptr)


@triton.jit(do_not_specialize=["T", "M", "s_mt"])
def _stack_kernel(X, LN1W, LN1B, WQKV, WO, BO, LN3W, LN3B, W1, B1, W2, B2, MASK, QKV, ATT, SMID, H1, S, CNT,
                  T, M, s_mt, eps, scale, NB: tl.constexpr, NBATCH: tl.constexpr, C: tl.constexpr,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, COLS_A: tl.constexpr,
                  COLS_C: tl.constexpr, COLS_D: tl.constexpr, COLS_E: tl.constexpr, IEEE: tl.constexpr):
    HD: tl.constexpr = H * D
    F: tl.constexpr = 4 * C
    NA_R: tl.constexpr = 3 * HD // COLS_A  # items per row block of each stage
    NC_R: tl.constexpr = C // COLS_C
    ND_R: tl.constexpr = F // COLS_D
    NE_R: tl.constexpr = C // COLS_E
    RB = tl.cdiv(M, 16)
    n_a = RB * NA_R
    n_ab = n_a + NBATCH * H
    n_abc = n_ab + RB * NC_R
    n_abcd = n_abc + RB * ND_R
    per_block = n_abcd + RB * NE_R
    cstride = 4 * RB + NBATCH  # counters per block: A[RB], B[NBATCH], C[RB], D[RB], E[RB]

    item = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")
    while item < NB * per_block:
        blk = item // per_block
        r = item % per_block
        cnt_a = CNT + 1 + blk * cstride
        cnt_b = cnt_a + RB
        cnt_c = cnt_b + NBATCH
        cnt_d = cnt_c + RB
        cnt_e = cnt_d + RB
        # The block's input: the stack's, or the block before's output once that block's E of the rows is done.
        src = X
        if blk > 0:
            src = S + (blk - 1) * M * C
        need = tl.where(blk > 0, NE_R, 0)
        qkv = QKV + blk * M * (3 * HD)
        att = ATT + blk * M * HD
        smid = SMID + blk * M * C
        h1 = H1 + blk * M * F
        if r < n_a:
            rb = r // NA_R
            _stage_qkv(src, cnt_e - cstride + rb, need, LN1W + blk * C, LN1B + blk * C, WQKV + blk * C * (3 * HD),
                       qkv, cnt_a + rb, rb, r % NA_R, M, eps, C, 3 * HD, COLS_A, IEEE)
        elif r < n_ab:
            b = (r - n_a) // H
            _stage_attention(qkv, MASK, att, cnt_a, NA_R, cnt_b + b, b, (r - n_a) % H, T, s_mt, scale, H, D,
                             BLOCK_T, IEEE)
        elif r < n_abc:
            rb = (r - n_ab) // NC_R
            _stage_out(att, WO + blk * C * HD, BO + blk * C, src, smid, cnt_b, H, cnt_c + rb, rb, (r - n_ab) % NC_R,
                       T, M, C, HD, COLS_C, IEEE)
        elif r < n_abcd:
            rb = (r - n_abc) // ND_R
            _stage_ff1(smid, LN3W + blk * C, LN3B + blk * C, W1 + blk * C * F, B1 + blk * F, h1, cnt_c + rb, NC_R,
                       cnt_d + rb, rb, (r - n_abc) % ND_R, M, eps, C, COLS_D, IEEE)
        else:
            rb = (r - n_abcd) // NE_R
            _stage_ff2(h1, W2 + blk * C * F, B2 + blk * C, smid, S + blk * M * C, cnt_d + rb, ND_R, cnt_e + rb, rb,
                       (r - n_abcd) % NE_R, M, C, COLS_E, IEEE)
        item = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")


def _cols(k: int, n: int, widest: int = 64) -> int:
    """Columns per item: a power of two dividing n, the [k, cols] weight tile within TILE elements (at least 16)."""
    cols = 16
    while cols * 2 <= min(widest, TILE // k) and n % (cols * 2) == 0:
        cols *= 2
    return cols


def transformer_stack(x: torch.Tensor, w: StackWeights, mask: torch.Tensor, programs: int | None = None
                      ) -> torch.Tensor:
    """The blocks of one stack in one kernel: x [B, T, C] (dense rows) -> [B, T, C], as the blocks' forward with
    pending None in and the last block's residual added. mask additive [T, T] (dense rows). `programs`: the
    kernel's program count (default one per SM)."""
    nb_batch, t, c = x.shape
    if not stack_fits(w, nb_batch, t):
        raise ValueError(f"a stack of width {c} over {nb_batch} x {t} rows is outside transformer_stack's sizes")
    if x.stride(2) != 1 or x.stride(1) != c or mask.stride(-1) != 1:
        raise ValueError("x and the mask need dense rows")
    if mask.shape != (t, t):
        raise ValueError(f"mask {tuple(mask.shape)} is not one [{t}, {t}] window mask for every batch row")
    nblocks = w.wqkv.shape[0]
    hd = w.heads * w.head_dim
    m = nb_batch * t
    rb = triton.cdiv(m, ROWS)
    dev, dt = x.device, x.dtype
    qkv = torch.empty(nblocks, m, 3 * hd, device=dev, dtype=dt)
    o = torch.empty(nblocks, m, hd, device=dev, dtype=dt)
    smid = torch.empty(nblocks, m, c, device=dev, dtype=dt)
    h1 = torch.empty(nblocks, m, 4 * c, device=dev, dtype=dt)
    s = torch.empty(nblocks, m, c, device=dev, dtype=dt)
    cnt = torch.zeros(1 + nblocks * (4 * rb + nb_batch), device=dev, dtype=torch.int32)
    cols_a, cols_c, cols_d, cols_e = _cols(c, 3 * hd), _cols(hd, c), _cols(c, 4 * c), _cols(4 * c, c)
    items = nblocks * (rb * (3 * hd // cols_a + c // cols_c + 4 * c // cols_d + c // cols_e) + nb_batch * w.heads)
    if programs is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if x.is_cuda else 4
        programs = sms * PROGRAMS_PER_SM
    _stack_kernel[(max(1, min(programs, items)),)](
        x, w.ln1_w, w.ln1_b, w.wqkv, w.wo, w.bo, w.ln3_w, w.ln3_b, w.w1, w.b1, w.w2, w.b2, mask, qkv, o, smid, h1, s,
        cnt, t, m, mask.stride(-2), w.eps, w.head_dim ** -0.5, NB=nblocks, NBATCH=nb_batch, C=c, H=w.heads,
        D=w.head_dim, BLOCK_T=max(16, triton.next_power_of_2(t)), COLS_A=cols_a, COLS_C=cols_c, COLS_D=cols_d,
        COLS_E=cols_e, IEEE=dt == torch.float32, num_warps=WARPS, num_stages=1)
    return s[-1].view(nb_batch, t, c)
