"""CUDA graphs for the flow's Euler solve (10 steps x ~1000 small kernels per chunk: launch-bound at small batch).

One graph per (padded batch, window length). Batches are padded up to the next bucket by repeating the last
row (rows are independent, so real rows are unchanged) and outputs are sliced back. Opt-in
(`CodecDecoder.load(..., cuda_graphs=True)`); the eager path is the reference. Graphs are captured on first use;
`capture_steady_state` captures the steady-state window of every bucket ahead of time (the engine process does
it at load), so no user's answer pays a capture.
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

    @torch.inference_mode()  # as run_jobs: no autograd state in the captured solve
    def capture_steady_state(self, max_batch: int) -> int:
        """Capture the graph of the steady-state window (est_ctx_frames + a full chunk's frames) for every bucket
        up to the one holding `max_batch` sessions. Returns how many graphs were newly captured."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        flow = self.flow
        cfg, st = flow.cfg, flow.stream
        F, C = st.chunk_codes * cfg.token_mel_ratio, st.est_ctx_frames
        top = self._bucket(max_batch)
        n = 0
        for Bp in [b for b in BUCKETS if b < top] + [top]:
            if (Bp, F) in self.graphs:
                continue
            n_mel, kw = cfg.output_size, {"device": flow.device, "dtype": flow.dtype}
            # z, ctx_traj, mu_w, cond_w, spks: shapes as in FlowModel._solve (values are replaced at every replay).
            inputs = [torch.zeros(Bp, n_mel, F, **kw), torch.zeros(Bp, cfg.n_timesteps, n_mel, C, **kw),
                      torch.zeros(Bp, n_mel, C + F, **kw), torch.zeros(Bp, n_mel, C + F, **kw),
                      torch.zeros(Bp, n_mel, **kw)]
            self.graphs[(Bp, F)] = self._capture(inputs)
            n += 1
        return n

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
