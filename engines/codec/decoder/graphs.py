"""CUDA graphs for the flow's Euler solve (10 steps x ~1000 small kernels per chunk: launch-bound at small batch).

One graph per (padded batch, window length). Batches are padded up to the next bucket by repeating the last
row (rows are independent, so real rows are unchanged) and outputs are sliced back. Opt-in
(`CodecDecoder.load(..., cuda_graphs=True)`); the eager path is the reference.
"""

from __future__ import annotations

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EulerGraphs:
    def __init__(self, flow) -> None:
        self.flow = flow
        self.pool = None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple]] = {}

    @staticmethod
    def _bucket(b: int) -> int:
        for s in BUCKETS:
            if b <= s:
                return s
        return b

    def _capture(self, inputs: list[torch.Tensor]):
        static = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy inits and allocator state outside the graph
                self.flow.euler(*static)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.flow.euler(*static)
        self.pool = g.pool()
        return g, static, out

    def run(self, z, ctx_traj, mu_w, cond_w, spks) -> tuple[torch.Tensor, torch.Tensor]:
        B = z.shape[0]
        Bp = self._bucket(B)
        inputs = [z, ctx_traj, mu_w, cond_w, spks]
        if Bp != B:
            inputs = [torch.cat([t, t[-1:].expand(Bp - B, *t.shape[1:])]) for t in inputs]
        key = (Bp, z.shape[2])
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        g, static, out = self.graphs[key]
        for dst, src in zip(static, inputs, strict=True):
            dst.copy_(src)
        g.replay()
        return out[0][:B].clone(), out[1][:B].clone()
