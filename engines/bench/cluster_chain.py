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

Mode "push" (session 55) turns the exchange around: every block keeps its own copy of each stage's input, and the
owner of an output slice stores it into the copies of the blocks that read it (16-byte `st.shared::cluster` stores
posted before the barrier), so every read is local; its GEMMs run on `mma.sync` with the weights packed in fragment
order and fetched by the tensor memory accelerator; `Chain.trace` reads block 0's clock at each stage's phases.

Measured (H200, sessions 54-55; docs/bench/cluster-chain-*-h200-s5[45].txt, per stage of a 308-stage call, 32 rows,
two weight buffers): peer tile loads ("full") 12.75 us, inputs gathered first ("gather") 9.05, "push" 5.88 against
3.85 with the pushes skipped ("push-local"); the served kernels take ~3.1 us a stage (9.6 ms a solve). The pushes
cost ~2 us a stage (stores ~14-17 GB/s per SM into the peers, the barrier's release ~0.5 us waiting for them), 2.9
at 48 rows: more than the ~2.25 us a stage, all in, that a 10 ms chunk leaves the solve (docs/PERF_NOTES.md,
session 55).
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

// Block `rank`'s slice of a stage's weights in the packed vector (its offset split in two ints in the record).
__device__ __forceinline__ const bf16* slice_of(const bf16* weights, const Stage& st, int rank) {
  return weights + (((long long)st.w_hi << 32) | (unsigned)st.w_lo) + rank * slice_elems(st);
}

// A stage's epilogue, element i of this block's [R, n / C] output: its `parts` partial sums in res, the residual
// stream added and carried (resid stages), the tanh; the value as stored (bf16).
__device__ __forceinline__ bf16 finish(const Stage& st, const float* res, int parts, float* resid, int R, int i) {
  float v = 0.f;
  for (int g = 0; g < parts; ++g) v += res[g * R * (st.n / C) + i];
  if (st.resid) v += resid[i];
  if (st.act) v = tanhf(v);
  if (st.resid) resid[i] = v;
  return __float2bfloat16(v);
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

// Causal attention of one head for this block's ncols of its v: softmax(q k^T / sqrt(64)) v[:, mine], q at column
// qc, k at kc, the block's v at vc of `src`. Scores, probabilities and the output [R, ncols] go to `scratch`;
// returns where the output is.
__device__ const float* attention(cg::cluster_group& cluster, const Input& src, int qc, int kc, int vc, int ncols,
                          float* scratch, int R, int mode) {
  const int MT = R / 16, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
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
  return O;
}

// The attention stage of the head this block's output columns belong to; q, k, v are the qkv stage's output
// (columns [0, 512), [512, 1024), [1024, 1536) over all blocks), read from their owners or gathered first.
__device__ const float* attn_stage(cg::cluster_group& cluster, const Stage& st, const bf16* in, bf16* copy,
                                   float* scratch, int R, int mode) {
  const int ncols = st.n / C, kp = st.cin / C;
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
  return attention(cluster, src, qc, kc, vc, ncols, scratch, R, mode);
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
    fetch_weights(wbuf + s * max_slice, slice_of(weights, st, rank), slice_elems(st));
  }
  cluster.sync();
  for (int s = 0; s < total; ++s) {
    const Stage st = stages[s % L];
    const int ahead = s + nb - 1;
    if (ahead < total) {  // its buffer's last reader was stage s - 1, ended by the barrier
      const Stage sa = stages[ahead % L];
      fetch_weights(wbuf + (ahead % nb) * max_slice, slice_of(weights, sa, rank), slice_elems(sa));
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
      res = attn_stage(cluster, st, in, copy, scratch, R, mode);
      parts = 1;
    }
    for (int i = threadIdx.x; i < R * ncols; i += THREADS) dst[PAD * ncols + i] = finish(st, res, parts, resid, R, i);
    cluster.sync();  // this stage's outputs visible to the cluster; its inputs free to be overwritten
  }
  const Stage last = stages[(total - 1) % L];
  const int ncols = last.n / C;
  const bf16* fin = act + ((total - 1) & 1) * buf_elems + PAD * ncols;
  for (int i = threadIdx.x; i < R * ncols; i += THREADS) out[rank * R * ncols + i] = fin[i];
}

// ---- mode "push": every block keeps its own copy of each stage's input; the owner of an output slice stores it
// into the copies of every block that reads it (16-byte stores to the peers' shared memory, posted before the
// barrier), so all reads of a stage are local; the GEMMs run on mma.sync with weights packed in fragment order.
// A push stage: Stage's fields, then its input region (offset, row length) in the block's arena, the next stage's,
// how the output goes there (0: every block, same columns; 1: an attention's q | k | v-part layout), the attention's
// columns a block, warps along n.
struct PStage { Stage b; int in_off, in_ld, nx_off, nx_ld, nx_kind, nx_acols, wn, pad; };

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// out[R, n / C] = causal-conv(in)[R, taps * cin] @ W. in: this block's copy of the whole input (rows of in_ld);
// W: [k16 step][n8 tile][lane][4] (each lane's B fragment, 8 bytes). Warps: wn along the n8 tiles (NW each), 8 / wn
// along the k steps (interleaved); partial sums [8 / wn, R, n / C] in scratch. MT (row tiles) and NW are template
// arguments: with them known, a k step's fragment loads are unconditional and go out before its products.
template <int MT, int NW>
__device__ void mma_gemm_t(const PStage& st, const bf16* W, const bf16* in, float* scratch, int R) {
  const int ncols = st.b.n / C, nt8 = ncols / 8, wn = st.wn, wk = WARPS / wn;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wni = warp % wn, wki = warp / wn;
  const int kc = st.b.cin / 16;
  float acc[MT][NW][4] = {};
  for (int t = 0; t < st.b.taps; ++t) {  // (the causal taps: rows t - (taps - 1) above)
    const bf16* arow = in + (PAD - (st.b.taps - 1 - t) + lane % 16) * st.in_ld + (lane / 16) * 8;
    const uint2* wt = reinterpret_cast<const uint2*>(W + ((size_t)t * kc * nt8 + wni * NW) * 128) + lane;
#pragma unroll 2
    for (int kk = wki; kk < kc; kk += wk) {
      unsigned a[MT][4];
      uint2 b[NW];
#pragma unroll
      for (int m = 0; m < MT; ++m) ldsm_x4(a[m], arow + m * 16 * st.in_ld + kk * 16);
#pragma unroll
      for (int j = 0; j < NW; ++j) b[j] = wt[kk * nt8 * 32 + j * 32];
#pragma unroll
      for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int m = 0; m < MT; ++m) mma16816(acc[m][j], a[m], b[j].x, b[j].y);
    }
  }
  float* part = scratch + wki * R * ncols;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const int r = m * 16 + lane / 4, c = (wni * NW + j) * 8 + 2 * (lane % 4);
      *reinterpret_cast<float2*>(part + r * ncols + c) = make_float2(acc[m][j][0], acc[m][j][1]);
      *reinterpret_cast<float2*>(part + (r + 8) * ncols + c) = make_float2(acc[m][j][2], acc[m][j][3]);
    }
  __syncthreads();
}

template <int MT>
__device__ void mma_gemm_rows(const PStage& st, const bf16* W, const bf16* in, float* scratch, int R) {
  switch (st.b.n / C / 8 / st.wn) {  // (n8 tiles a warp: 1-4, `warps_along_n`)
    case 1: mma_gemm_t<MT, 1>(st, W, in, scratch, R); break;
    case 2: mma_gemm_t<MT, 2>(st, W, in, scratch, R); break;
    case 3: mma_gemm_t<MT, 3>(st, W, in, scratch, R); break;
    default: mma_gemm_t<MT, 4>(st, W, in, scratch, R); break;
  }
}

__device__ void mma_gemm(const PStage& st, const bf16* W, const bf16* in, float* scratch, int R) {
  switch (R / 16) {  // (16-64 rows, `check_stages`)
    case 1: mma_gemm_rows<1>(st, W, in, scratch, R); break;
    case 2: mma_gemm_rows<2>(st, W, in, scratch, R); break;
    case 3: mma_gemm_rows<3>(st, W, in, scratch, R); break;
    default: mma_gemm_rows<4>(st, W, in, scratch, R); break;
  }
}

// 16 bytes into block `d`'s shared memory at the place `mine` has in this block's (mapa + st.shared::cluster: no
// generic addressing).
__device__ __forceinline__ void st_peer(const bf16* mine, int d, uint4 v) {
  unsigned a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(mine)), "r"(d));
  asm volatile("st.shared::cluster.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// This block's output tile [R, ncols] (stile) into the next stage's input copies of the blocks that read it.
__device__ void push_out(cg::cluster_group& cluster, const PStage& st, bf16* arena, const bf16* stile, int R) {
  const int ncols = st.b.n / C, vecs = ncols / 8, rank = cluster.block_rank();
  if (st.nx_kind == 0) {  // the next stage is a GEMM: every block reads every column
    // A thread per (vector, group of destinations): one division per vector, then a store per destination.
    const int items = R * vecs, G = THREADS / items > 1 ? THREADS / items : 1, g = threadIdx.x % G;
    for (int i = threadIdx.x / G; i < items; i += THREADS / G) {
      const int r = i / vecs, c = (i % vecs) * 8;
      const uint4 v = *reinterpret_cast<const uint4*>(stile + r * ncols + c);
      bf16* mine = arena + st.nx_off + (PAD + r) * st.nx_ld + rank * ncols + c;
      for (int d = g; d < C; d += G) st_peer(mine, d, v);
    }
    return;
  }
  // The next stage is attention: q and k of head h go to its blocks (q | k at columns 0 | 64), v's columns to the
  // block owning them (column 128 on).
  const int inner = st.b.n / 3, ac = st.nx_acols, bph = 64 / ac;
  for (int i = threadIdx.x; i < R * vecs; i += THREADS) {
    const int r = i / vecs, c = (i % vecs) * 8, g = rank * ncols + c;
    const uint4 v = *reinterpret_cast<const uint4*>(stile + r * ncols + c);
    if (g < 2 * inner) {
      const int part = g / inner, h = (g % inner) / 64, dc = part * 64 + g % 64;
      for (int b = 0; b < bph; ++b) st_peer(arena + st.nx_off + (PAD + r) * st.nx_ld + dc, h * bph + b, v);
    } else {
      const int cc = g - 2 * inner;
      st_peer(arena + st.nx_off + (PAD + r) * st.nx_ld + 128 + cc % ac, cc / ac, v);
    }
  }
}

// Mode "push"'s weights by the tensor memory accelerator: one thread asks for a stage's slice as one bulk copy that
// completes on the buffer's mbarrier, which every thread then waits on (no warp issues 16-byte copies).
__device__ __forceinline__ void bulk_fetch(bf16* dst, const bf16* src, int elems, unsigned long long* bar) {
  const unsigned bytes = elems * 2;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (generic reads of the buffer before it)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void bulk_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// The chain in mode "push", `reps` times over. weights: `pack_fragments`' vector; x: [C, R, RESID] (every block
// reads all of it: stage 0's input copy); out as `chain`'s. trace (or null): block 0's clock at each stage's start,
// after its record is read and the next weights asked for, after its weights landed, after its products, after its
// pushes ([total, 5]), then clock and global timer (ns) at the kernel's start and end.
__global__ void __launch_bounds__(THREADS) chain_push(const PStage* stages, int L, int reps, const bf16* weights,
                                                      const bf16* x, bf16* out, int R, int nb, int max_slice,
                                                      int arena_elems, int stile_elems, int scratch_floats,
                                                      int exchange, long long* trace) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = cluster.block_rank(), total = L * reps;
  const bool tr = trace != nullptr && rank == 0 && threadIdx.x == 0;
  if (tr) trace[5 * total] = clock64(), trace[5 * total + 1] = globaltimer();
  bf16* wbuf = reinterpret_cast<bf16*>(smem);                        // [nb, max_slice]
  bf16* arena = wbuf + nb * max_slice;                               // [arena_elems]: the stages' input copies
  bf16* stile = arena + arena_elems;                                 // [R, n / C]: this block's output of a stage
  float* scratch = reinterpret_cast<float*>(stile + stile_elems);    // [scratch_floats]
  float* resid = scratch + scratch_floats;                           // [R, RESID]
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(resid + R * RESID);  // [2]: the buffers' mbarriers
  PStage* recs = reinterpret_cast<PStage*>(bars + 2);  // [3]: the records of stages s, s + 1, s + 2 (slot s % 3)
  if (threadIdx.x < 32)  // (stages 0 and 1)
    reinterpret_cast<int*>(recs)[threadIdx.x] = reinterpret_cast<const int*>(stages + (threadIdx.x / 16) % L)[
        threadIdx.x % 16];
  if (threadIdx.x == 0) {
    for (int b = 0; b < nb; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(bars + b)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const PStage s0 = recs[0];
  bf16* in0 = arena + s0.in_off;
  for (int i = threadIdx.x; i < PAD * s0.in_ld; i += THREADS) in0[i] = __float2bfloat16(0.f);
  for (int i = threadIdx.x; i < R * s0.b.cin; i += THREADS) {  // the whole input, every block
    const int r = i / s0.b.cin, c = i % s0.b.cin;
    in0[(PAD + r) * s0.in_ld + c] = x[(c / RESID) * R * RESID + r * RESID + c % RESID];
  }
  for (int i = threadIdx.x; i < R * RESID; i += THREADS) resid[i] = __bfloat162float(x[rank * R * RESID + i]);
  for (int s = 0; s < nb - 1 && s < total && threadIdx.x == 0; ++s) {  // (nb <= 2: stage 0 at most)
    const PStage st = recs[s];
    if (slice_elems(st.b)) bulk_fetch(wbuf + s * max_slice, slice_of(weights, st.b, rank), slice_elems(st.b), bars + s);
  }
  cluster.sync();  // (every block's memory is ready before a peer stores into it)
  unsigned phases = 0;  // bit b: the parity of buffer b's next completion
  for (int s = 0; s < total; ++s) {
    if (tr) trace[5 * s] = clock64();
    const PStage st = recs[s % 3];
    // Stage s + 2's record, a word a thread, stored into its slot at the end of this stage: a global load right
    // after the cluster barrier (an acquire: the L1 is dropped) costs ~0.9 us.
    const int rec_word = threadIdx.x < 16 ? reinterpret_cast<const int*>(stages + (s + 2) % L)[threadIdx.x] : 0;
    const int ahead = s + nb - 1;
    if (ahead < total && threadIdx.x == 0) {  // its buffer's last reader was stage s - 1, ended by the barrier
      const PStage sa = recs[ahead % 3];
      if (slice_elems(sa.b))
        bulk_fetch(wbuf + (ahead % nb) * max_slice, slice_of(weights, sa.b, rank), slice_elems(sa.b),
                   bars + ahead % nb);
    }
    // The next stage's copy: its rows above the first stay zero (the convs' causal taps read them); peers store
    // only below them, and its last reader was stage s - 1, ended by the barrier.
    bf16* nx = arena + st.nx_off;
    for (int i = threadIdx.x; i < PAD * st.nx_ld; i += THREADS) nx[i] = __float2bfloat16(0.f);
    if (tr) trace[5 * s + 1] = clock64();
    if (slice_elems(st.b)) {  // (each thread waits: the copy's bytes are visible to it once the phase completes)
      bulk_wait(bars + s % nb, (phases >> (s % nb)) & 1);
      phases ^= 1u << (s % nb);
    }
    if (tr) trace[5 * s + 2] = clock64();
    const bf16* in = arena + st.in_off;
    const int ncols = st.b.n / C;
    const float* res;
    int parts;
    if (st.b.kind == K_GEMM) {
      mma_gemm(st, wbuf + (s % nb) * max_slice, in, scratch, R);
      parts = WARPS / st.wn;
      res = scratch;
    } else {
      res = attention(cluster, Input{in, st.in_ld, 0, true}, 0, 64, 128, ncols, scratch, R, M_LOCAL);  // (local)
      parts = 1;
    }
    if (tr) trace[5 * s + 3] = clock64();
    for (int i = threadIdx.x; i < R * ncols; i += THREADS) stile[i] = finish(st.b, res, parts, resid, R, i);
    __syncthreads();
    if (s + 1 == total)
      for (int i = threadIdx.x; i < R * ncols; i += THREADS) out[rank * R * ncols + i] = stile[i];
    else if (exchange)  // (0: mode "push-local", a timing variant)
      push_out(cluster, st, arena, stile, R);
    if (tr) trace[5 * s + 4] = clock64();
    if (threadIdx.x < 16) reinterpret_cast<int*>(recs + (s + 2) % 3)[threadIdx.x] = rec_word;
    cluster.sync();  // the pushes visible to their readers; this stage's input copy free to be overwritten
  }
  if (tr) trace[5 * total + 2] = clock64(), trace[5 * total + 3] = globaltimer();
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

void run_push(torch::Tensor stages, torch::Tensor weights, torch::Tensor x, torch::Tensor out, torch::Tensor trace,
              int64_t reps, int64_t nb, int64_t max_slice, int64_t arena, int64_t stile, int64_t scratch_floats,
              int64_t exchange, int64_t stream) {
  const int R = x.size(1), L = stages.size(0);
  const size_t smem = (size_t)(nb * max_slice + arena + stile) * sizeof(bf16)
                      + (size_t)(scratch_floats + R * RESID) * sizeof(float) + 2 * sizeof(unsigned long long)
                      + 3 * 16 * sizeof(int);  // (the mbarriers, the stage records)
  cudaError_t e = launch_cluster(chain_push, C, THREADS, smem, reinterpret_cast<cudaStream_t>(stream),
      reinterpret_cast<const PStage*>(stages.data_ptr<int>()), L, (int)reps,
      reinterpret_cast<const bf16*>(weights.data_ptr<at::BFloat16>()),
      reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>()), reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()),
      R, (int)nb, (int)max_slice, (int)arena, (int)stile, (int)scratch_floats, (int)exchange,
      trace.numel() ? reinterpret_cast<long long*>(trace.data_ptr<int64_t>()) : nullptr);
  TORCH_CHECK(e == cudaSuccess, "cluster launch (", smem, " bytes of shared memory): ", cudaGetErrorString(e));
}
"""

_CPP = ("void run(torch::Tensor stages, torch::Tensor weights, torch::Tensor x, torch::Tensor out, int64_t reps, "
        "int64_t nb, int64_t max_slice, int64_t max_ld, int64_t scratch_floats, int64_t copy_elems, int64_t mode, "
        "int64_t stream);\n"
        "void run_push(torch::Tensor stages, torch::Tensor weights, torch::Tensor x, torch::Tensor out, "
        "torch::Tensor trace, int64_t reps, int64_t nb, int64_t max_slice, int64_t arena, int64_t stile, "
        "int64_t scratch_floats, int64_t exchange, int64_t stream);")
_ext = None
MODES = {"full": 0, "local": 1, "no-math": 2, "gather": 3, "push": 4, "push-local": 5}  # (push*: their own kernel)


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


def pack_fragments(stages: list[Stage], flat: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """`pack`'s vector with each block's [K, n / C] slice reordered for mode "push": mma.sync B fragments
    [K / 16, n / C / 8, 32 lanes, 4], lane 4 g + q holding column g of its n8 tile at k = 2q, 2q + 1, 2q + 8, 2q + 9
    of the k step (PTX m16n8k16 .bf16), so a warp reads a fragment as 256 contiguous bytes."""
    out = flat.clone()
    for st, off in zip(stages, offsets, strict=True):
        if st.kind != "gemm":
            continue
        nc = st.n // CLUSTER
        sl = flat[off:off + st.k * st.n].reshape(CLUSTER, st.k // 16, 2, 4, 2, nc // 8, 8)  # [b, ks, h, q, p, t8, g]
        out[off:off + st.k * st.n] = sl.permute(0, 1, 5, 6, 3, 2, 4).reshape(-1)
    return out


def copy_width(st: Stage) -> int:
    """The columns of a stage's input a block keeps in its own memory (modes "gather" and "push"): every column of a
    GEMM's input; for attention its head's q and k and its part of v."""
    return st.cin if st.kind == "gemm" else 128 + st.n // CLUSTER


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _copy_elems(rows: int, ld: int) -> int:
    """A push copy's elements: its rows (pad rows included) in whole 32-byte units (wmma's tile alignment)."""
    return _round_up((PAD + rows) * ld, 16)


def push_regions(stages: list[Stage], rows: int) -> list[tuple[int, int]]:
    """(offset, row length) of each stage's input copy in a block's arena (mode "push", elements). Two copies are
    live at a time, a stage's (read) and the next one's (written by the peers), so consecutive stages' copies must not
    overlap; neither may the last stage's and the first's (the next call's). Rows are 8 elements longer than the
    input (16 bytes: an ldmatrix's 8 rows fall in different banks)."""
    lds = [copy_width(st) + 8 for st in stages]
    sizes = [_copy_elems(rows, ld) for ld in lds]
    offs = [0]
    for s in range(1, len(stages)):
        offs.append(0 if sizes[s] <= offs[-1] else offs[-1] + sizes[s - 1])
    if offs[-1] < sizes[0]:
        raise ValueError("the last stage's input copy overlaps the first's: the chain cannot wrap in mode 'push'")
    return list(zip(offs, lds, strict=True))


def warps_along_n(st: Stage, rows: int) -> int:
    """Mode "push": of the 8 warps, how many split a GEMM's n8 tiles (the rest split its k steps): the fewest that
    leave a warp <= 4 tiles, its partial sums (8 / wn of [rows, n / C]) within rows x 192 floats (so that 48 rows fit
    a block's shared memory)."""
    nt8 = st.n // CLUSTER // 8
    for wn in (1, 2, 4, 8):
        if nt8 % wn == 0 and nt8 // wn <= 4 and (8 // wn) * (st.n // CLUSTER) <= 192:
            return wn
    raise ValueError(f"no warp split for a stage writing {st.n} columns")


def push_table(stages: list[Stage], offsets: list[int], rows: int) -> torch.Tensor:
    """[L, 16] int32: `table`'s records, then each stage's input copy, the next stage's and how the output goes there
    (0: every block, 1: an attention's q | k | v-part), the attention's columns a block, warps along n."""
    regions = push_regions(stages, rows)
    base = table(stages, offsets)
    extra = []
    for i, st in enumerate(stages):
        nxt = stages[(i + 1) % len(stages)]
        wn = warps_along_n(st, rows) if st.kind == "gemm" else 1
        extra.append([*regions[i], *regions[(i + 1) % len(stages)], int(nxt.kind == "attn"), nxt.n // CLUSTER, wn,
                      0])
    return torch.cat([base, torch.tensor(extra, dtype=torch.int32)], dim=1)


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
                           functions=["run", "run_push"], extra_cuda_cflags=["-O3", "-arch=sm_90a"])
    return _ext


@dataclass
class Chain:
    """A chain ready on the GPU: its tables, packed weights and shared memory plan."""
    stages: list[Stage]
    table: torch.Tensor
    flat: torch.Tensor
    rows: int
    push_table: torch.Tensor  # mode "push"'s records
    fragments: torch.Tensor  # mode "push"'s weights (`pack_fragments`)

    @classmethod
    def build(cls, stages: list[Stage], weights: list[torch.Tensor | None], rows: int, device: torch.device) -> Chain:
        check_stages(stages, rows)
        flat, offsets = pack(stages, weights)
        flat = flat.to(device)
        return cls(stages, table(stages, offsets).to(device), flat, rows,
                   push_table(stages, offsets, rows).to(device), pack_fragments(stages, flat, offsets))

    def _slice_and_attention(self) -> tuple[int, int]:
        """What both kernels' layouts share: the largest weight slice a block fetches (attention reads none) and the
        floats an attention stage's scores, probabilities and output take."""
        r = self.rows
        max_slice = max(st.k * st.n // CLUSTER for st in self.stages if st.kind == "gemm")
        attn = max((r * r + r * r // 2 + r * st.n // CLUSTER for st in self.stages if st.kind == "attn"), default=0)
        return max_slice, attn

    def push_plan(self, nb: int) -> tuple[int, int, int, int, int]:
        """Mode "push": (max weight slice, arena, output tile and scratch elements, shared memory bytes)."""
        r = self.rows
        max_slice, attn = self._slice_and_attention()
        arena = max(off + _copy_elems(r, ld) for off, ld in push_regions(self.stages, r))
        stile = _round_up(r * max(st.n // CLUSTER for st in self.stages), 16)
        gemm = max(8 // warps_along_n(st, r) * r * st.n // CLUSTER for st in self.stages if st.kind == "gemm")
        scratch = _round_up(max(gemm, attn), 32)
        smem = 2 * (nb * max_slice + arena + stile) + 4 * (scratch + r * RESID) + 16 + 192  # (mbarriers, records)
        return max_slice, arena, stile, scratch, smem

    def plan(self, nb: int, mode: str) -> tuple[int, int, int, int, int]:
        """(max weight slice elements, max activation columns a block, scratch floats, input copy elements, shared
        memory bytes) for `nb` weight buffers in `mode`; the kernel's layout (binding's `smem`)."""
        r = self.rows
        max_slice, attn = self._slice_and_attention()
        max_ld = max(st.n // CLUSTER for st in self.stages)
        gemm = max(max(r * st.n // CLUSTER, 8 * 256) for st in self.stages if st.kind == "gemm")
        scratch = _round_up(max(gemm, attn), 32)  # (whole 128-byte lines: what follows stays aligned)
        copy = 0
        if mode == "gather":
            copy = (PAD + r) * max(copy_width(st) for st in self.stages)
        smem = 2 * (nb * max_slice + 2 * (PAD + r) * max_ld + copy) + 4 * (scratch + r * RESID)
        return max_slice, max_ld, scratch, copy, smem

    def run(self, x: torch.Tensor, reps: int = 1, nb: int = 2, mode: str = "full") -> torch.Tensor:
        """x [R, 256] bf16 on the GPU -> the chain's output after `reps` passes, [R, 256] bf16. `mode`: "full"
        (tiles read from their owners' shared memory), "gather" (each stage first copies the input columns it
        needs into the block's own memory) or "push" (each block stores its outputs into the input copies of the
        blocks that read them; products on mma.sync); timing variants with wrong outputs: "local" reads every input
        part from the block's own shared memory, "no-math" skips the products (weights still fetched, epilogue and
        barrier), "push-local" skips the pushes."""
        return self._run(x, reps, nb, mode, None)

    def trace(self, x: torch.Tensor, reps: int = 1, nb: int = 2, mode: str = "push") -> tuple[torch.Tensor, float]:
        """Mode "push" (or "push-local") with block 0's clock read at each stage's phases: [reps * L, 5] nanoseconds
        a stage spends reading its record and asking for the next weights, waiting for its weights, in its products
        (or attention), in its epilogue and pushes, at the cluster barrier; and the SM clock over the launch (GHz,
        from the global timer)."""
        total = reps * len(self.stages)
        buf = torch.zeros(5 * total + 4, dtype=torch.int64, device=x.device)
        self._run(x, reps, nb, mode, buf)
        t = buf.cpu()
        ns_per_clock = (t[-1] - t[-3]).item() / (t[-2] - t[-4]).item()
        marks = t[:5 * total].reshape(total, 5)
        ends = torch.cat([marks[1:, 0], t[-2:-1]])  # (the next stage's start; the kernel's end for the last)
        spans = torch.cat([marks[:, 1:] - marks[:, :-1], (ends - marks[:, 4])[:, None]], dim=1)
        return spans.double() * ns_per_clock, 1 / ns_per_clock

    def _run(self, x: torch.Tensor, reps: int, nb: int, mode: str, trace: torch.Tensor | None) -> torch.Tensor:
        if nb not in (1, 2):  # (a second buffer saved 0.7 of 12 us a stage on an H200: a third is not offered)
            raise ValueError(f"nb (weight buffers) must be 1 or 2, got {nb}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        if mode.startswith("push"):
            max_slice, arena, stile, scratch, smem = self.push_plan(nb)
        else:
            max_slice, max_ld, scratch, copy, smem = self.plan(nb, mode)
        if smem > SMEM_LIMIT:
            raise ValueError(f"{self.rows} rows with {nb} weight buffers in mode {mode!r} need {smem} bytes of shared "
                             f"memory, a block has {SMEM_LIMIT}: fewer rows or one buffer")
        r = self.rows
        xs = x.reshape(r, CLUSTER, RESID).transpose(0, 1).contiguous()  # [C, R, 16]: each block's columns
        out = torch.empty_like(xs)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        if mode.startswith("push"):
            no_trace = torch.empty(0, dtype=torch.int64, device=x.device)
            _module().run_push(self.push_table, self.fragments, xs, out, no_trace if trace is None else trace, reps,
                               nb, max_slice, arena, stile, scratch, int(mode == "push"), stream)
        else:
            _module().run(self.table, self.flat, xs, out, reps, nb, max_slice, max_ld, scratch, copy, MODES[mode],
                          stream)
        return out.transpose(0, 1).reshape(r, CLUSTER * RESID)


def stage_label(st: Stage) -> str:
    if st.kind == "attn":
        return "attn"
    if st.taps > 1:
        return "conv"
    return {(256, 1536): "qkv", (512, 256): "out", (256, 1024): "ff1", (1024, 256): "ff2"}.get((st.cin, st.n), "gemm")


def phase_split(stages: list[Stage], ns: torch.Tensor) -> str:
    """`Chain.trace`'s phases, the launch's last call only (the first pays the launch): mean us a stage, all stages and
    by kind."""
    ns = ns[-len(stages):]
    labels = [stage_label(st) for st in stages]
    names = ("record", "weights", "math", "epilogue+push", "barrier")

    def fmt(rows: torch.Tensor) -> str:
        m = rows.mean(0) / 1e3
        return " ".join(f"{n} {v:.2f}" for n, v in zip(names, m.tolist(), strict=True)) + f" = {m.sum():.2f}"

    parts = [f"all {len(stages)}: {fmt(ns)}"]
    for lab in dict.fromkeys(labels):
        idx = [i for i, x in enumerate(labels) if x == lab]
        parts.append(f"{lab} x{len(idx)}: {fmt(ns[idx])}")
    return "; ".join(parts)


def main() -> None:
    from engines.bench.hardware import device_name, measure_bandwidth, median, timed

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,48", help="rows a stage (batch 1 with CFG: 2 x 20 frames, padded to 48)")
    ap.add_argument("--nb", default="1,2", help="weight buffers: 1 (no fetch ahead) or 2 (the next stage's)")
    ap.add_argument("--modes", default="full,gather,local,no-math,push,push-local",
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
                if mode in ("full", "gather", "push"):  # (the timing variants compute something else)
                    err = (out.cpu().float() - ref.float()).abs()
                    check = f", |diff| from the reference max {err.max():.4f} mean {err.mean():.5f}"
                line.append(f"{mode} {ms:.3f} ms ({ms / args.reps / len(stages) * 1e3:.2f} us a stage{check})")
            print(" ".join(line) + f"; served solve {args.served_solve_ms} ms", flush=True)
            for mode in (m for m in args.modes.split(",") if m.startswith("push")):
                try:
                    ns, ghz = chain.trace(x, 2, nb, mode)
                except ValueError:  # (shared memory, printed above)
                    continue
                print(f"  {mode}, block 0's phases (us a stage, SM clock {ghz:.2f} GHz): {phase_split(stages, ns)}")

if __name__ == "__main__":
    main()
