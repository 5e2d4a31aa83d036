"""The cluster hand-off variants of `engines.bench.handoff` (`--cluster`): N dependent stages inside one launch of a
thread-block cluster (Hopper), each stage ended by the cluster's hardware barrier instead of a kernel boundary or a
counter in L2. Built on first use with torch's C++ extension loader (nvcc; sm_90).

Each of the cluster's C blocks is a program with a [16, WIDTH] float32 tile, as in the other variants: a stage reads
the neighbour block's tile of the stage before, adds one and writes its own; then every block waits at the barrier.
- `dsmem`: tiles in each block's shared memory (two buffers), the neighbour's read through distributed shared memory;
- `global`: tiles in global memory (L2: loads bypass L1), the barrier orders them;
- `barrier`: the barrier alone (no tile): what the barrier itself costs per stage.
The cluster's barrier has release / acquire semantics at cluster scope, so a block's writes of a stage are seen by its
peers after it in either memory.
"""

from __future__ import annotations

import torch

from engines.bench.cluster_launch import LAUNCH_CLUSTER

_CUDA = r"""
#include <cooperative_groups.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>
namespace cg = cooperative_groups;

constexpr int TILE = 16 * 256;  // floats per block's tile
constexpr int THREADS = 256;

// mode 0: tiles in shared memory, read from the neighbour block's (DSMEM); 1: tiles in global memory; 2: barrier only
__global__ void stages(float* gbuf, float* out, int n, int mode) {
  extern __shared__ float4 smem4[];
  cg::cluster_group cluster = cg::this_cluster();
  const int c = cluster.num_blocks(), rank = cluster.block_rank(), peer = (rank + 1) % c;
  float4* mine[2] = {smem4, smem4 + TILE / 4};
  float4* g = reinterpret_cast<float4*>(gbuf);  // [2, c, TILE]
  for (int i = threadIdx.x; i < TILE / 4; i += THREADS) {
    mine[0][i] = make_float4(0.f, 0.f, 0.f, 0.f);
    g[rank * TILE / 4 + i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  cluster.sync();
  for (int s = 0; s < n; ++s) {
    if (mode == 0) {
      const float4* src = cluster.map_shared_rank(mine[s & 1], peer);
      for (int i = threadIdx.x; i < TILE / 4; i += THREADS) {
        float4 x = src[i];
        mine[(s + 1) & 1][i] = make_float4(x.x + 1.f, x.y + 1.f, x.z + 1.f, x.w + 1.f);
      }
    } else if (mode == 1) {
      const float4* src = g + ((s & 1) * c + peer) * TILE / 4;
      float4* dst = g + (((s + 1) & 1) * c + rank) * TILE / 4;
      for (int i = threadIdx.x; i < TILE / 4; i += THREADS) {
        float4 x = __ldcg(src + i);
        __stcg(dst + i, make_float4(x.x + 1.f, x.y + 1.f, x.z + 1.f, x.w + 1.f));
      }
    }
    cluster.sync();
  }
  const float4* last = mode == 0 ? mine[n & 1] : g + ((n & 1) * c + rank) * TILE / 4;
  for (int i = threadIdx.x; i < TILE / 4; i += THREADS)
    reinterpret_cast<float4*>(out)[rank * TILE / 4 + i] = mode == 2 ? make_float4(n, n, n, n) : last[i];
}

void run(torch::Tensor gbuf, torch::Tensor out, int64_t blocks, int64_t n, int64_t mode) {
  const int smem = 2 * TILE * sizeof(float);
  cudaError_t e = launch_cluster(stages, (int)blocks, THREADS, smem, at::cuda::getCurrentCUDAStream(),
                                 gbuf.data_ptr<float>(), out.data_ptr<float>(), (int)n, (int)mode);
  TORCH_CHECK(e == cudaSuccess, "cluster launch of ", blocks, " blocks: ", cudaGetErrorString(e));
}
"""

_CPP = "void run(torch::Tensor gbuf, torch::Tensor out, int64_t blocks, int64_t n, int64_t mode);"
MODES = {"dsmem": 0, "global": 1, "barrier": 2}
_ext = None


def _module():
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load_inline

        _ext = load_inline("moss_cluster_handoff", _CPP, cuda_sources=LAUNCH_CLUSTER + _CUDA, functions=["run"],
                           extra_cuda_cflags=["-O3", "-arch=sm_90"])
    return _ext


def cluster_stages(gbuf: torch.Tensor, out: torch.Tensor, blocks: int, n: int, mode: str) -> None:
    """n stages in one launch of a cluster of `blocks` blocks; gbuf [2, blocks, 16, 256] and out [blocks, 16, 256]
    float32 (out: every block's tile after the last stage, all n)."""
    _module().run(gbuf, out, blocks, n, MODES[mode])
