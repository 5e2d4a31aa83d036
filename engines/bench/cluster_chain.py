"""Can one thread-block cluster run the codec estimator's batch-1 chain faster than its kernels do? A probe for issue 4.

At batch 1 a chunk's solve is 10 estimator calls of ~300 dependent stages each, every stage a kernel whose weights'
HBM reads start only when the kernel before it lets them (docs/PERF_NOTES.md, session 46: 9.6 ms of the 12.7 ms
chunk, 8.8 ms even with every weight in L2). A cluster of 16 blocks can keep the activations in its shared memory,
hand a stage over at its hardware barrier (0.27 us, session 26) and fetch the next stage's weights while this one
computes (cp.async into a second buffer), so a stage costs its own work on 16 SMs, not a weight fetch plus a
boundary. This probe measures that, on the estimator's real shapes with random weights, before anyone writes the
real thing:

- the chain of one estimator call: 14 blocks (down, 12 mid, up) of a resnet (two causal convs, kernel 3, 256 -> 256)
  and 4 transformer blocks (qkv 256 -> 1536, causal attention of 8 heads x 64, out 512 -> 256, ff 256 -> 1024 ->
  256): 308 stages, 64.3 M bf16 weights (~128.6 MB, the served estimator's ~130 MiB);
- each block of the cluster owns 1/16 of every stage's output columns; a stage's input is read from the blocks
  that own it through distributed shared memory (wmma tiles loaded straight from the peer's shared memory);
- left out (each a few elementwise operations in a stage's prologue or epilogue): LayerNorm, Mish / GELU, the time
  embedding, the up block's skip concat (its conv reads 512 channels), the final projection, the Euler update.
  Every stage output passes a tanh instead, so that ~3,000 stages of random weights stay bounded.

`reference_chain` is the same chain in torch (float32 products of bf16 values, outputs rounded to bf16 as the
kernel stores them): tests/gpu/test_cluster_chain_gpu.py checks the kernel against it.
`python3 -m engines.bench.cluster_chain` (Hopper, nvcc) prints the time per stage and per solve next to the copy
bandwidth floor of the weights measured in the same run.

Measured (H200, session 54; docs/bench/cluster-chain-h200-s54.txt): the kernel matches the reference (a whole call at
32 rows: max |diff| 0.0073, mean 0.001) but takes 12.0-12.7 us a stage, 37-39 ms for a solve's 10 calls against the
served kernels' 9.6 ms; fetching the next stage's weights ahead saved 0.7 us a stage, so the time is the blocks' own
work. Where it goes (the "local" and "no-math" variants) and the "gather" variant are not measured yet.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import partial

import torch

from engines.bench.cluster_launch import LAUNCH_CLUSTER

CLUSTER = 16  # blocks of the cluster (a non-portable size: Hopper allows 16)
PAD = 2  # zero rows above each activation buffer: the causal conv's taps read them
SMEM_LIMIT = 232448  # dynamic shared memory a block may have on Hopper (227 KiB)
RESID = 16  # the residual stream's columns per block (256 / CLUSTER)

_CUDA = r"""
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <mma.h>
namespace cg = cooperative_groups;
using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int C = 16, PAD = 2, RESID = 16, THREADS = 256, WARPS = THREADS / 32, U = 8;
enum { K_GEMM = 0, K_ATTN = 1 };
// A stage: kind, taps, cin (input width, all blocks), n (output width), resid, tanh, weight offset (lo, hi)
struct Stage { int kind, taps, cin, n, resid, act, w_lo, w_hi; };

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// One block's slice of a stage's weights ([taps * cin, n / C], contiguous) into shared memory, 16 bytes a copy.
__device__ __forceinline__ void fetch_weights(bf16* dst, const bf16* src, int elems) {
  for (int i = threadIdx.x * 8; i < elems; i += THREADS * 8)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_u32(dst + i)), "l"(src + i));
  asm volatile("cp.async.commit_group;" ::: "memory");  // (an empty group for a stage without weights)
}

__device__ __forceinline__ void wait_weights(int nb) {  // this stage's group landed; nb - 1 later ones may fly
  if (nb == 1) asm volatile("cp.async.wait_group 0;" ::: "memory");
  else asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// How a stage reads element (row, col) of its input [PAD + R, cin] (each block owning cin / C columns): from the
// owning block's shared memory (mode 0, served), from this block's own (mode 1: a timing variant, wrong numbers), or
// from a copy in this block's memory of the columns the stage needs (mode 3, `gather`: 16-byte loads from the owners
// first, then every tile load local).
enum { M_FULL = 0, M_LOCAL = 1, M_NO_MATH = 2, M_GATHER = 3 };
struct Input { const bf16* base; int ld, kp; bool copy; };

__device__ __forceinline__ const bf16* elem(cg::cluster_group& cluster, const Input& in, int mode, int row, int col) {
  if (in.copy) return in.base + row * in.ld + col;
  const bf16* b = mode == M_LOCAL ? in.base : cluster.map_shared_rank(in.base, col / in.kp);
  return b + row * in.kp + col % in.kp;
}

__device__ __forceinline__ int ld_of(const Input& in) { return in.copy ? in.ld : in.kp; }

// Columns [c, c + w) of the input, every row, into dst's columns [d, d + w) (rows of ld): 16 bytes a load.
__device__ void gather(cg::cluster_group& cluster, const bf16* in, int kp, int rows, int c, int w, bf16* dst, int ld,
                       int d) {
  const int vecs = w / 8;
  for (int i = threadIdx.x; i < rows * vecs; i += THREADS) {
    const int r = i / vecs, v = (i % vecs) * 8, col = c + v;
    *reinterpret_cast<uint4*>(dst + r * ld + d + v) =
        *reinterpret_cast<const uint4*>(cluster.map_shared_rank(in, col / kp) + r * kp + col % kp);
  }
}

__device__ __forceinline__ int slice_elems(const Stage& st) {
  return st.kind == K_GEMM ? st.taps * st.cin * (st.n / C) : 0;
}

// The stage's GEMM: out[R, n / C] = causal-conv(in)[R, taps * cin] @ W; in read from its owners' shared memory.
// Warps take output tiles; with fewer tiles than warps they split K and sum in `scratch`.
__device__ void gemm_stage(cg::cluster_group& cluster, const Stage& st, const bf16* W, const bf16* in, bf16* copy,
                           float* scratch, int R, int mode) {
  const int ncols = st.n / C, NT = ncols / 16, MT = R / 16, T = MT * NT;
  const int kp = st.cin / C, kc = st.cin / 16, ks_all = st.taps * kc;
  Input src{in, 0, kp, false};
  if (mode == M_GATHER) {
    gather(cluster, in, kp, PAD + R, 0, st.cin, copy, st.cin, 0);
    src = Input{copy, st.cin, kp, true};
    __syncthreads();
  }
  const int lda = ld_of(src);
  const int S = T >= WARPS ? 1 : WARPS / T, warp = threadIdx.x / 32;
  for (int u = warp; u < T * S; u += WARPS) {
    const int tile = u % T, g = u / T, mt = tile / NT, nt = tile % NT;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int base = g; base < ks_all; base += S * U) {  // U k-steps' loads in flight before their products
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[U];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b[U];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int ks = base + j * S;
        if (ks >= ks_all) break;
        const int t = ks / kc, col = (ks % kc) * 16;
        wmma::load_matrix_sync(a[j], elem(cluster, src, mode, PAD + mt * 16 - (st.taps - 1 - t), col), lda);
        wmma::load_matrix_sync(b[j], W + ks * 16 * ncols + nt * 16, ncols);
      }
#pragma unroll
      for (int j = 0; j < U; ++j)
        if (base + j * S < ks_all) wmma::mma_sync(acc, a[j], b[j], acc);
    }
    wmma::store_matrix_sync(scratch + g * R * ncols + mt * 16 * ncols + nt * 16, acc, ncols, wmma::mem_row_major);
  }
  __syncthreads();
}

// Causal attention of the head this block's output columns belong to: softmax(q k^T / sqrt(64)) v[:, mine].
// q, k, v are the qkv stage's output (columns [0, 512), [512, 1024), [1024, 1536) over all blocks).
__device__ void attn_stage(cg::cluster_group& cluster, const Stage& st, const bf16* in, bf16* copy, float* scratch,
                           int R, int mode) {
  const int ncols = st.n / C, kp = st.cin / C, MT = R / 16, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c0 = cluster.block_rank() * ncols, head = c0 / 64, half = c0 % 64;
  // The columns this block reads: its head's q and k, its part of the head's v (a copy holds them side by side).
  int qc = head * 64, kc = 512 + head * 64, vc = 1024 + head * 64 + half;
  Input src{in, 0, kp, false};
  if (mode == M_GATHER) {
    const int ld = 128 + ncols;
    gather(cluster, in, kp, PAD + R, qc, 64, copy, ld, 0);
    gather(cluster, in, kp, PAD + R, kc, 64, copy, ld, 64);
    gather(cluster, in, kp, PAD + R, vc, ncols, copy, ld, 128);
    src = Input{copy, ld, kp, true};
    qc = 0, kc = 64, vc = 128;
    __syncthreads();
  }
  const int lda = ld_of(src);
  float* S = scratch;                                   // [R, R] scores
  bf16* P = reinterpret_cast<bf16*>(scratch + R * R);    // [R, R] probabilities
  float* O = scratch + R * R + R * R / 2;                // [R, ncols]
  for (int u = warp; u < MT * MT; u += WARPS) {
    const int mi = u / MT, ni = u % MT;
    if (ni > mi) continue;  // (above the diagonal: masked whole)
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kk = 0; kk < 4; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;  // k^T: k's rows as columns
      wmma::load_matrix_sync(a, elem(cluster, src, mode, PAD + mi * 16, qc + kk * 16), lda);
      wmma::load_matrix_sync(b, elem(cluster, src, mode, PAD + ni * 16, kc + kk * 16), lda);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(S + mi * 16 * R + ni * 16, acc, R, wmma::mem_row_major);
  }
  __syncthreads();
  for (int i = warp; i < R; i += WARPS) {  // a warp per row
    float m = -INFINITY;
    for (int j = lane; j <= i; j += 32) m = fmaxf(m, S[i * R + j] * 0.125f);
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.f;
    for (int j = lane; j <= i; j += 32) sum += __expf(S[i * R + j] * 0.125f - m);
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    for (int j = lane; j < R; j += 32)
      P[i * R + j] = __float2bfloat16(j <= i ? __expf(S[i * R + j] * 0.125f - m) / sum : 0.f);
  }
  __syncthreads();
  const int NT = ncols / 16;
  for (int u = warp; u < MT * NT; u += WARPS) {
    const int mi = u / NT, nt = u % NT;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kk = 0; kk <= mi; ++kk) {  // (P is zero right of the diagonal tile)
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
      wmma::load_matrix_sync(a, P + mi * 16 * R + kk * 16, R);
      wmma::load_matrix_sync(b, elem(cluster, src, mode, PAD + kk * 16, vc + nt * 16), lda);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(O + mi * 16 * ncols + nt * 16, acc, ncols, wmma::mem_row_major);
  }
  __syncthreads();
}

// The whole chain, `reps` times over (the solve's Euler steps), in one launch of one cluster of C blocks.
// weights: every stage's slices, [C, taps * cin, n / C] each at its offset; x: [C, R, RESID]; out: [C, R, n_last / C]
__global__ void __launch_bounds__(THREADS) chain(const Stage* stages, int L, int reps, const bf16* weights,
                                                 const bf16* x, bf16* out, int R, int nb, int max_slice, int max_ld,
                                                 int scratch_floats, int copy_elems, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = cluster.block_rank(), buf_elems = (PAD + R) * max_ld;
  bf16* wbuf = reinterpret_cast<bf16*>(smem);                        // [nb, max_slice]
  bf16* act = wbuf + nb * max_slice;                                 // [2, PAD + R, ld]
  float* scratch = reinterpret_cast<float*>(act + 2 * buf_elems);    // [scratch_floats]
  float* resid = scratch + scratch_floats;                           // [R, RESID]
  bf16* copy = reinterpret_cast<bf16*>(resid + R * RESID);           // [copy_elems]: mode M_GATHER's input copy
  for (int i = threadIdx.x; i < 2 * PAD * max_ld; i += THREADS)  // pad rows: written by no stage (ld >= 16)
    act[(i / (PAD * max_ld)) * buf_elems + i % (PAD * max_ld)] = __float2bfloat16(0.f);
  __syncthreads();  // (the input below lands inside the zeroed prefix when max_ld > RESID)
  for (int i = threadIdx.x; i < R * RESID; i += THREADS) {  // the input, as stage -1's output (buffer 1)
    const bf16 v = x[rank * R * RESID + i];
    act[buf_elems + PAD * RESID + i] = v;
    resid[i] = __bfloat162float(v);
  }
  const int total = L * reps;
  for (int s = 0; s < nb - 1 && s < total; ++s) {
    const Stage st = stages[s % L];
    const long long off = ((long long)st.w_hi << 32) | (unsigned)st.w_lo;
    fetch_weights(wbuf + s * max_slice, weights + off + rank * slice_elems(st), slice_elems(st));
  }
  cluster.sync();
  for (int s = 0; s < total; ++s) {
    const Stage st = stages[s % L];
    const int ahead = s + nb - 1;
    if (ahead < total) {  // its buffer's last reader was stage s - 1, ended by the barrier
      const Stage sa = stages[ahead % L];
      const long long off = ((long long)sa.w_hi << 32) | (unsigned)sa.w_lo;
      fetch_weights(wbuf + (ahead % nb) * max_slice, weights + off + rank * slice_elems(sa), slice_elems(sa));
    } else {
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    wait_weights(nb);
    __syncthreads();
    const bf16* in = act + ((s + 1) & 1) * buf_elems;
    bf16* dst = act + (s & 1) * buf_elems;
    const int ncols = st.n / C;
    const float* res;
    int parts;
    if (mode == M_NO_MATH) {  // (timing variant: no products, the epilogue sums whatever scratch holds)
      parts = 1;
      res = scratch;
    } else if (st.kind == K_GEMM) {
      gemm_stage(cluster, st, wbuf + (s % nb) * max_slice, in, copy, scratch, R, mode);
      const int T = (R / 16) * (ncols / 16);
      parts = T >= WARPS ? 1 : WARPS / T;
      res = scratch;
    } else {
      attn_stage(cluster, st, in, copy, scratch, R, mode);
      parts = 1;
      res = scratch + R * R + R * R / 2;
    }
    for (int i = threadIdx.x; i < R * ncols; i += THREADS) {
      float v = 0.f;
      for (int g = 0; g < parts; ++g) v += res[g * R * ncols + i];
      if (st.resid) v += resid[i];
      if (st.act) v = tanhf(v);
      if (st.resid) resid[i] = v;
      dst[PAD * ncols + i] = __float2bfloat16(v);
    }
    cluster.sync();  // this stage's outputs visible to the cluster; its inputs free to be overwritten
  }
  const Stage last = stages[(total - 1) % L];
  const int ncols = last.n / C;
  const bf16* fin = act + ((total - 1) & 1) * buf_elems + PAD * ncols;
  for (int i = threadIdx.x; i < R * ncols; i += THREADS) out[rank * R * ncols + i] = fin[i];
}
"""

_BINDING = r"""
#include <torch/extension.h>

void run(torch::Tensor stages, torch::Tensor weights, torch::Tensor x, torch::Tensor out, int64_t reps, int64_t nb,
         int64_t max_slice, int64_t max_ld, int64_t scratch_floats, int64_t copy_elems, int64_t mode,
         int64_t stream) {
  const int R = x.size(1), L = stages.size(0);
  const size_t smem = (size_t)(nb * max_slice + 2 * (PAD + R) * max_ld + copy_elems) * sizeof(bf16)
                      + (size_t)(scratch_floats + R * RESID) * sizeof(float);
  cudaError_t e = launch_cluster(chain, C, THREADS, smem, reinterpret_cast<cudaStream_t>(stream),  // (torch's stream)
      reinterpret_cast<const Stage*>(stages.data_ptr<int>()), L, (int)reps,
      reinterpret_cast<const bf16*>(weights.data_ptr<at::BFloat16>()),
      reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>()), reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()),
      R, (int)nb, (int)max_slice, (int)max_ld, (int)scratch_floats, (int)copy_elems, (int)mode);
  TORCH_CHECK(e == cudaSuccess, "cluster launch (", smem, " bytes of shared memory): ", cudaGetErrorString(e));
}
"""

_CPP = ("void run(torch::Tensor stages, torch::Tensor weights, torch::Tensor x, torch::Tensor out, int64_t reps, "
        "int64_t nb, int64_t max_slice, int64_t max_ld, int64_t scratch_floats, int64_t copy_elems, int64_t mode, "
        "int64_t stream);")
_ext = None
MODES = {"full": 0, "local": 1, "no-math": 2, "gather": 3}


@dataclass(frozen=True)
class Stage:
    kind: str  # "gemm" | "attn"
    cin: int  # input width (all blocks)
    n: int  # output width
    taps: int = 1  # causal conv kernel (gemm)
    resid: bool = False  # add the residual stream, then carry the result as the new stream
    act: bool = True  # tanh on the output

    @property
    def k(self) -> int:
        return self.taps * self.cin


def estimator_stages(blocks: int = 14, transformers: int = 4, ch: int = 256, heads: int = 8, head_dim: int = 64,
                     ff: int = 1024) -> list[Stage]:
    """One estimator call's chain (module doc): per block a resnet (two causal convs) and `transformers` blocks."""
    inner = heads * head_dim
    out: list[Stage] = []
    for _ in range(blocks):
        out += [Stage("gemm", ch, ch, taps=3), Stage("gemm", ch, ch, taps=3, resid=True)]
        for _ in range(transformers):
            out += [Stage("gemm", ch, 3 * inner), Stage("attn", 3 * inner, inner, act=False),
                    Stage("gemm", inner, ch, resid=True), Stage("gemm", ch, ff), Stage("gemm", ff, ch, resid=True)]
    return out


def check_stages(stages: list[Stage], rows: int) -> None:
    """The shapes the kernel handles; ValueError naming the first stage it does not."""
    if rows % 16 or not 16 <= rows <= 64:
        raise ValueError(f"rows must be a multiple of 16 in 16..64, got {rows}")
    width = RESID * CLUSTER
    for i, st in enumerate(stages):
        if st.cin != width:
            raise ValueError(f"stage {i} reads {st.cin} columns, the stage before wrote {width}")
        if st.n % (16 * CLUSTER) or st.cin % (16 * CLUSTER):
            raise ValueError(f"stage {i}: widths must be multiples of {16 * CLUSTER}")
        if st.resid and st.n != RESID * CLUSTER:
            raise ValueError(f"stage {i}: a residual stage must write {RESID * CLUSTER} columns")
        if st.taps > 1 and st.cin != RESID * CLUSTER:  # (the pad rows stay zero only below every stage's first row)
            raise ValueError(f"stage {i}: a conv must read {RESID * CLUSTER} columns")
        if st.kind == "attn" and (st.cin != 3 * st.n or st.n // CLUSTER > 64 or 64 % (st.n // CLUSTER)):
            raise ValueError(f"stage {i}: attention reads q, k, v of 64-wide heads and writes a head's part a block")
        width = st.n
    if width != RESID * CLUSTER:
        raise ValueError(f"the chain must end on {RESID * CLUSTER} columns (the next call's input)")


def random_weights(stages: list[Stage], seed: int = 0) -> list[torch.Tensor | None]:
    """[taps * cin, n] float32 per GEMM stage (None for attention), scaled so each stage is a contraction."""
    g = torch.Generator().manual_seed(seed)
    return [None if st.kind == "attn" else torch.randn(st.k, st.n, generator=g) * (0.5 / math.sqrt(st.k))
            for st in stages]


def pack(stages: list[Stage], weights: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[int]]:
    """Every GEMM stage's weight as CLUSTER column slices [CLUSTER, K, n / CLUSTER], one bf16 vector; the offsets."""
    parts, offsets, at = [], [], 0
    for st, w in zip(stages, weights, strict=True):
        offsets.append(at)
        if w is None:
            continue
        sl = w.to(torch.bfloat16).reshape(st.k, CLUSTER, st.n // CLUSTER).permute(1, 0, 2).reshape(-1)
        parts.append(sl)
        at += sl.numel()
    return torch.cat(parts), offsets


def unpack_stage(flat: torch.Tensor, offset: int, st: Stage) -> torch.Tensor:
    """One stage's [K, n] weight back from `pack`'s vector (the kernel's view of it)."""
    sl = flat[offset:offset + st.k * st.n].reshape(CLUSTER, st.k, st.n // CLUSTER)
    return sl.permute(1, 0, 2).reshape(st.k, st.n)


def table(stages: list[Stage], offsets: list[int]) -> torch.Tensor:
    """[L, 8] int32, the kernel's Stage records."""
    rows = [[0 if st.kind == "gemm" else 1, st.taps, st.cin, st.n, int(st.resid), int(st.act),
             off & 0xFFFFFFFF, off >> 32] for st, off in zip(stages, offsets, strict=True)]
    t = torch.tensor(rows, dtype=torch.int64)
    t[:, 6] = torch.where(t[:, 6] >= 2**31, t[:, 6] - 2**32, t[:, 6])  # (the low word as the int32 it is)
    return t.to(torch.int32)


def reference_chain(stages: list[Stage], weights: list[torch.Tensor | None], x: torch.Tensor, reps: int = 1
                    ) -> torch.Tensor:
    """The kernel's chain in torch: x [R, 256] bf16 -> [R, 256] bf16 (products in float32 of bf16 values; every
    stage output rounded to bf16, the residual stream kept in float32, as the kernel does)."""
    bf = [None if w is None else w.to(torch.bfloat16).float() for w in weights]
    h = x.float()
    resid = h.clone()
    rows = h.shape[0]
    for _ in range(reps):
        for st, w in zip(stages, bf, strict=True):
            if st.kind == "attn":
                inner = st.n
                q, k, v = h[:, :inner], h[:, inner:2 * inner], h[:, 2 * inner:]
                heads = inner // 64
                q, k, v = (t.reshape(rows, heads, 64).transpose(0, 1) for t in (q, k, v))  # [heads, R, 64]
                s = q @ k.transpose(1, 2) * 0.125
                s = s.masked_fill(torch.ones(rows, rows, dtype=torch.bool).triu(1), float("-inf"))
                p = torch.softmax(s, dim=-1).to(torch.bfloat16).float()
                y = (p @ v).transpose(0, 1).reshape(rows, inner)
            else:
                a = torch.cat([torch.cat([h.new_zeros(st.taps - 1 - t, st.cin), h[:rows - (st.taps - 1 - t)]])
                               for t in range(st.taps)], dim=1)  # [R, taps * cin]: causal taps
                y = a @ w
            if st.resid:
                y = y + resid
            if st.act:
                y = torch.tanh(y)
            if st.resid:
                resid = y.clone()
            h = y.to(torch.bfloat16).float()
    return h.to(torch.bfloat16)


def _module():
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load_inline

        _ext = load_inline("moss_cluster_chain", _CPP, cuda_sources=LAUNCH_CLUSTER + _CUDA + _BINDING,
                           functions=["run"], extra_cuda_cflags=["-O3", "-arch=sm_90a"])
    return _ext


@dataclass
class Chain:
    """A chain ready on the GPU: its table, packed weights and shared memory plan."""
    stages: list[Stage]
    table: torch.Tensor
    flat: torch.Tensor
    rows: int

    @classmethod
    def build(cls, stages: list[Stage], weights: list[torch.Tensor | None], rows: int, device: torch.device) -> Chain:
        check_stages(stages, rows)
        flat, offsets = pack(stages, weights)
        return cls(stages, table(stages, offsets).to(device), flat.to(device), rows)

    def plan(self, nb: int, mode: str) -> tuple[int, int, int, int, int]:
        """(max weight slice elements, max activation columns a block, scratch floats, input copy elements, shared
        memory bytes) for `nb` weight buffers in `mode`; the kernel's layout (binding's `smem`)."""
        r = self.rows
        max_slice = max(st.k * st.n // CLUSTER for st in self.stages if st.kind == "gemm")  # (attention reads none)
        max_ld = max(st.n // CLUSTER for st in self.stages)
        gemm = max(max(r * st.n // CLUSTER, 8 * 256) for st in self.stages if st.kind == "gemm")
        attn = max((r * r + r * r // 2 + r * st.n // CLUSTER for st in self.stages if st.kind == "attn"), default=0)
        scratch = -(-max(gemm, attn) // 32) * 32  # (whole 128-byte lines: what follows stays aligned)
        copy = 0
        if mode == "gather":  # every column of a GEMM's input; q, k and the block's part of v for attention
            copy = (PAD + r) * max(st.cin if st.kind == "gemm" else 128 + st.n // CLUSTER for st in self.stages)
        smem = 2 * (nb * max_slice + 2 * (PAD + r) * max_ld + copy) + 4 * (scratch + r * RESID)
        return max_slice, max_ld, scratch, copy, smem

    def run(self, x: torch.Tensor, reps: int = 1, nb: int = 2, mode: str = "full") -> torch.Tensor:
        """x [R, 256] bf16 on the GPU -> the chain's output after `reps` passes, [R, 256] bf16. `mode`: "full"
        (tiles read from their owners' shared memory) or "gather" (each stage first copies the input columns it
        needs into the block's own memory); timing variants with wrong outputs: "local" reads every input part from
        the block's own shared memory, "no-math" skips the products (weights still fetched, epilogue and barrier)."""
        if nb not in (1, 2):  # (a second buffer saved 0.7 of 12 us a stage on an H200: a third is not offered)
            raise ValueError(f"nb (weight buffers) must be 1 or 2, got {nb}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        max_slice, max_ld, scratch, copy, smem = self.plan(nb, mode)
        if smem > SMEM_LIMIT:
            raise ValueError(f"{self.rows} rows with {nb} weight buffers in mode {mode!r} need {smem} bytes of shared "
                             f"memory, a block has {SMEM_LIMIT}: fewer rows or one buffer")
        r = self.rows
        xs = x.reshape(r, CLUSTER, RESID).transpose(0, 1).contiguous()  # [C, R, 16]: each block's columns
        out = torch.empty_like(xs)
        _module().run(self.table, self.flat, xs, out, reps, nb, max_slice, max_ld, scratch, copy, MODES[mode],
                      torch.cuda.current_stream(x.device).cuda_stream)
        return out.transpose(0, 1).reshape(r, CLUSTER * RESID)

def main() -> None:
    from engines.bench.hardware import device_name, measure_bandwidth, median, timed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,48", help="rows a stage (batch 1 with CFG: 2 x 20 frames, padded to 48)")
    ap.add_argument("--nb", default="1,2", help="weight buffers: 1 (no fetch ahead) or 2 (the next stage's)")
    ap.add_argument("--modes", default="full,gather,local,no-math",
                    help=f"variants timed ({', '.join(MODES)}; Chain.run)")
    ap.add_argument("--reps", type=int, default=10, help="estimator calls a launch (a solve: 10 Euler steps)")
    ap.add_argument("--served-solve-ms", type=float, default=9.6,
                    help="the served batch-1 solve to compare with (sessions 46-47: 9.6-9.9 ms)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    stages = estimator_stages()
    weights = random_weights(stages)
    wbytes = sum(w.numel() for w in weights if w is not None) * 2
    bw = measure_bandwidth(dev, 2 << 30)
    floor = args.reps * wbytes / bw * 1e3
    print(f"device: {device_name(dev)}; {len(stages)} stages a call, {wbytes / 1e6:.1f} MB of bf16 weights; copy "
          f"{bw / 1e12:.2f} TB/s, so the weights of {args.reps} calls take >= {floor:.2f} ms")
    for rows in (int(r) for r in args.rows.split(",")):
        chain = Chain.build(stages, weights, rows, dev)
        x = (torch.randn(rows, CLUSTER * RESID) * 0.5).to(torch.bfloat16).to(dev)
        ref = reference_chain(stages, weights, x.cpu(), reps=1)
        for nb in (int(n) for n in args.nb.split(",")):
            line = [f"rows {rows}, nb {nb}:"]
            for mode in args.modes.split(","):
                try:
                    out = chain.run(x, reps=1, nb=nb, mode=mode)
                except ValueError as e:  # (shared memory: the mode does not fit these rows and buffers)
                    line.append(f"{mode} -- ({e})")
                    continue
                ms = 1e3 * median(timed(partial(chain.run, x, reps=args.reps, nb=nb, mode=mode), dev, repeats=7))
                check = ""
                if mode in ("full", "gather"):  # (the timing variants compute something else)
                    err = (out.cpu().float() - ref.float()).abs()
                    check = f", |diff| from the reference max {err.max():.4f} mean {err.mean():.5f}"
                line.append(f"{mode} {ms:.3f} ms ({ms / args.reps / len(stages) * 1e3:.2f} us a stage{check})")
            print(" ".join(line) + f"; served solve {args.served_solve_ms} ms", flush=True)

if __name__ == "__main__":
    main()
