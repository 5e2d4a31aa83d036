"""CUDA graphs of the speech encoder's transformer blocks for small steps (a commit, a few streams' audio).

Eagerly a step of the 16 blocks is ~300 kernel launches from Python: a commit of one stream took ~10 ms of host
time for ~2 ms of GPU work on an H200, and more on the service's encoder thread, which shares the GIL with the
engine loop (docs/PERF_NOTES.md). Every answer waits for its commit's codes, so the blocks of steps of up to
`max_batch` streams are replayed as one graph per bucket of (streams, new 50 Hz frames per stream, keys attended):
padding rows and tokens write their K/V into the pool's spare slot and attend to key 0 of it; the keys past a
stream's own are masked out. Bigger steps (held audio of many sessions) are GPU-bound and stay eager.

All buckets are captured ahead of time (`capture`); a step whose shape has no bucket runs eagerly. The graphs hold
the KV pool's tensors, so a growth of the pool (`KVPool.generation`) retires them: reserve the pool first.
"""

from __future__ import annotations

import logging
import time

import torch

from engines.codec.decoder.graphs import BucketGraphs

log = logging.getLogger("engines.codec")

BATCHES = (1, 2, 4, 8)  # streams with new frames in the step
FRAMES = (1, 2, 4, 8, 16, 32)  # new 50 Hz frames per stream (a commit after 0.32 s of held audio: ~20)
KEYS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)  # keys attended, then the segment's length


def _up(x: int, ladder: tuple[int, ...]) -> int | None:
    return next((s for s in ladder if x <= s), None)


class StepGraphs(BucketGraphs):
    """The blocks of `StreamingRunner.layers` as graphs keyed by (batch, n_max, t_max) buckets. Captured as the codec's
    graphs are (BucketGraphs: inputs cloned, the owner's private stream, one memory pool), but replayed on inputs
    already of their bucket's shapes: the layout's padding is the runner's (spare KV slot), not repeated rows."""

    def __init__(self, runner, max_batch: int = BATCHES[-1]) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        super().__init__(runner.layers, urgent=True)  # a commit's call waits on them
        self.runner = runner
        self.batches = tuple(b for b in BATCHES if b < max_batch) + (max_batch,)
        seg = runner.cfg.max_source_positions
        self.keys = tuple(t for t in KEYS if t < seg) + (seg,)
        self.generation = runner.kv.generation
        self.replays = 0

    @staticmethod
    def key(inputs, static: tuple) -> tuple[int, int, int]:
        """(batch, n_max, t_max) of layers' inputs (x, kv_slot, kv_pos, slots [batch], qpos [batch, n_max]) and
        static (t_max,)."""
        return (inputs[3].shape[0], inputs[4].shape[1], static[0])

    def sizes(self, batch: int, n_max: int, t_max: int) -> tuple[int, int, int] | None:
        """The bucket a step of `batch` streams, `n_max` new frames at most, `t_max` keys at most replays, or None
        (no such graph: run eagerly)."""
        if self.generation != self.runner.kv.generation:  # the pool grew: the graphs hold its old tensors
            log.warning("speech encoder KV pool grew after its graphs were captured: steps run eagerly from now on")
            self.graphs.clear()
            self.generation = self.runner.kv.generation
        key = (_up(batch, self.batches), _up(n_max, FRAMES), _up(t_max, self.keys))
        return key if key in self.graphs else None  # type: ignore[return-value]

    @torch.no_grad()
    def capture(self) -> int:
        """Capture every bucket; returns how many graphs that made."""
        t0 = time.perf_counter()
        r = self.runner
        kw = {"device": r.device, "dtype": torch.long}
        for b in self.batches:
            for n in FRAMES:
                for t in self.keys:
                    # Inputs as a step of padding only: the warm-up runs and the capture write nothing but the spare
                    # slot.
                    self.ensure([torch.zeros(b * n, r.cfg.d_model, device=r.device, dtype=r.dtype),  # x
                                 torch.full((b * n,), r.kv.spare, **kw), torch.zeros(b * n, **kw),  # kv_slot, kv_pos
                                 torch.full((b,), r.kv.spare, **kw), torch.zeros(b, n, **kw)], (t,))  # slots, qpos
        log.info("speech encoder: %d step graphs captured in %.1f s", len(self.graphs), time.perf_counter() - t0)
        return len(self.graphs)

    def run(self, key: tuple[int, int, int], *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Replay the bucket `key` (from `sizes`) on inputs of its shapes (x, kv_slot, kv_pos, slots, qpos); the
        output is the graph's own buffer, valid until the next replay."""
        graph, static, out = self.graphs[key]
        for dst, src in zip(static, inputs, strict=True):
            dst.copy_(src)
        graph.replay()
        self.replays += 1
        return out
