"""CUDA graphs of the speech encoder's whole step for small steps (a commit, a few streams' audio).

Eagerly a step is ~60 torch calls (frontend, convs, pooling, VQ) around the blocks' ~300 launches: a commit of one
stream took ~10 ms of host time for ~3 ms of GPU work, and under load 14-21 ms mean, because each call gives up the
GIL that the engine loop and the codec's threads share, and waits to get it back (2026-11-25).
Every answer waits for its commit's codes, so steps of up to `max_batch` streams are replayed as one graph per bucket
of (streams, new 50 Hz frames per stream, keys attended): the whole step reads and writes its streams' carried state
in the KV pool's state rows by index (slot_pool.py), so its input is one upload (indices, then samples) padded to the
bucket's sizes (`step_plan.plan_step`): padding frames, tokens and groups read harmless rows and write the spare's.
Bigger steps (held audio of many sessions) stay eager.

All buckets are captured ahead of time (`capture`); a step whose shape has no bucket runs eagerly. The graphs hold
the KV pool's tensors, so a growth of the pool (`KVPool.generation`) retires them: reserve the pool first.
"""

from __future__ import annotations

import logging
import time

import torch

from engines.speech_in.step_plan import StepSizes
from engines.speech_out.chunk_graphs import BucketGraphs

log = logging.getLogger("engines.audio")

BATCHES = (1, 2, 4, 8)  # streams in the step
FRAMES = (1, 2, 4, 8, 16, 32, 64)  # new 50 Hz frames per stream (a commit after 0.32 s of held audio: ~20)
KEYS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)  # keys attended, then the segment's length


def _up(x: int, ladder: tuple[int, ...]) -> int | None:
    return next((s for s in ladder if x <= s), None)


class StepGraphs(BucketGraphs):
    """`StreamingRunner.forward` as graphs keyed by their StepSizes, one per (streams, n_max, t_max) bucket. Captured
    as the codec's graphs are (BucketGraphs: inputs cloned, the owner's private stream, one memory pool), but replayed
    on inputs already of their bucket's sizes."""

    def __init__(self, runner, max_batch: int = BATCHES[-1]) -> None:
        """Captured (so replayed) on the most urgent priority, as a commit's call waits on them; `max_batch` is the last
        rung of the streams' ladder."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        super().__init__(runner.forward, urgent=True)
        self.runner = runner
        self.batches = tuple(b for b in BATCHES if b < max_batch) + (max_batch,)
        seg = runner.cfg.max_source_positions
        self.keys = tuple(t for t in KEYS if t < seg) + (seg,)
        self.generation = runner.kv.generation
        self.replays = 0

    @staticmethod
    def key(inputs, static: tuple) -> tuple:
        """(streams, StepSizes) of the graph: BucketGraphs keys lead with the batch."""
        return (static[0].streams, static[0])

    def bucket(self, streams: int, n_max: int, t_max: int):
        """The StepSizes of the bucket holding a step of `streams` streams, `n_max` new tokens (and twice that many
        mel frames) per stream at most, `t_max` keys at most, whether captured or not; None beyond the buckets."""
        b, n, t = _up(streams, self.batches), _up(n_max, FRAMES), _up(t_max, self.keys)
        if b is None or n is None or t is None:
            return None
        cfg, k = self.runner.cfg, self.runner.cfg.pooling_kernel_size
        return StepSizes(streams=b, fft_rows=2 * n * b, cols=2 * n, windows=2 * n * b, keep1=2 * b, tokens=n * b,
                         keep2=2 * b, batch=b, n_max=n, t_max=t, padded=True, groups=b * ((k - 1 + n) // k),
                         keep3=(k - 1) * b, samples=b * ((2 * n - 1) * cfg.hop_length + cfg.n_fft),
                         pool_kernel=k)

    def may_replay(self, streams: int) -> bool:
        """A step of this many streams may replay one of these graphs (captured over the pool's current tensors)."""
        return bool(self.graphs) and self.generation == self.runner.kv.generation and streams <= self.batches[-1]

    def sizes(self, streams: int, n_max: int, t_max: int):
        """The captured bucket a step of these sizes replays (see `bucket`), or None (run it eagerly)."""
        if self.generation != self.runner.kv.generation:  # the pool grew: the graphs hold its old tensors
            log.warning("speech encoder KV pool grew after its graphs were captured: steps run eagerly from now on")
            self.graphs.clear()
            self.generation = self.runner.kv.generation
        sz = self.bucket(streams, n_max, t_max)
        return sz if sz is not None and (sz.streams, sz) in self.graphs else None

    @torch.no_grad()
    def capture(self) -> int:
        """Capture every bucket; returns how many graphs that made."""
        t0 = time.perf_counter()
        for b in self.batches:
            for n in FRAMES:
                for t in self.keys:
                    sz = self.bucket(b, n, t)
                    self.ensure(self.runner.blank_inputs(sz), (sz,))
        log.info("speech encoder: %d step graphs (up to %d streams) captured in %.1f s", len(self.graphs),
                 self.batches[-1], time.perf_counter() - t0)
        return len(self.graphs)

    def run(self, sz, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """Replay the bucket of StepSizes `sz` (from `sizes`) on its input (indices and samples, `forward`); the outputs
        (codes, features) are the graph's own buffers, valid until the next replay."""
        graph, static, out = self.graphs[(sz.streams, sz)]
        for dst, src in zip(static, inputs, strict=True):
            dst.copy_(src)
        graph.replay()
        self.replays += 1
        return out
