"""The flow estimator's context cache: what a chunk's Euler solve leaves behind for the next chunk, in slot rows.

A chunk's new mel frames attend to the keys/values of the previous chunk's last `est_ctx_frames` frames, and each
causal conv reads the last `kernel - 1` frames of its input before the chunk; all of them at the same Euler step and
for the same (conditional or unconditional) window. They were computed once, by the previous chunk's solve, and kept
here, so a solve computes only its new frames (half the rows of a window that recomputed its context). The first
chunk's context is the voice's (`VoiceContext`, computed once per voice), copied into the stream's slot when it opens.

Layout. A slot holds two windows (conditional, unconditional): window row w = 2 * slot + branch.
  kv        [windows, steps, blocks, 2 (k, v), ctx, heads * head_dim]: rewritten in place by each solve (the attention
            kernel's program for a (window, head) reads it and then writes the new rows: nothing else touches them)
  tails[i]  [2 * windows, steps, kernel - 1, Cin] per conv: two rows per window (a parity), read from one and
            written to the other, because a conv's programs that read a window's tail are not the ones that write it
Slot `spare` (= capacity) takes the writes of a CUDA graph's padding windows; slot `blank` (capacity + 1) is never
written (zeros: a conv's input before the start). Growing reallocates every tensor (`generation` counts growths, so
graphs captured over the old ones are not replayed) after every kernel in flight has finished.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

import numpy as np
import torch

from engines.api import EngineError


class CtxPoolFullError(EngineError):
    """No free slot and no GPU memory to grow: the stream that asked fails, not the engine."""

    code = "server_busy"


@dataclass
class VoiceContext:
    """A voice's context for its streams' first chunk, as the rows of one slot: kv [2, steps, blocks, 2, ctx, HD];
    tails, per conv, [2, steps, kernel - 1, Cin] (one row per window)."""

    kv: torch.Tensor
    tails: list[torch.Tensor]


class CtxPool:
    def __init__(self, blocks: list, convs: list, steps: int, ctx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """blocks: the estimator's transformer blocks, convs: its causal convs of kernel > 1 (each block's and conv's
        position in these lists is its index into kv and tails)."""
        self.block_index = {id(b): i for i, b in enumerate(blocks)}
        self.conv_index = {id(c): i for i, c in enumerate(convs)}
        self._conv_shapes = [(c.kernel_size[0] - 1, c.in_channels) for c in convs]
        a = blocks[0].attn1
        self._kv_shape = (steps, len(blocks), 2, ctx, a.h * a.dh)
        self.ctx, self.dtype, self.device = ctx, dtype, device
        self.capacity = 0
        with torch.inference_mode():  # (every tensor of the pool is an inference tensor, written only in that mode)
            self.kv = torch.zeros(4, *self._kv_shape, dtype=dtype, device=device)
            self.tails = [torch.zeros(8, steps, k, c, dtype=dtype, device=device) for k, c in self._conv_shapes]
        self._free: list[int] = []
        self.in_use = 0
        self.generation = 0
        # Held while a solve's kernels are queued and while the tensors are written from outside a solve (a stream's
        # opening) or replaced (a growth): a growth must not swap tensors under kernels being queued on them.
        self.lock = threading.RLock()

    @property
    def spare(self) -> int:
        return self.capacity

    @property
    def blank(self) -> int:
        return self.capacity + 1

    def slot_bytes(self) -> int:
        per_window = int(np.prod(self._kv_shape)) + sum(2 * self._kv_shape[0] * k * c for k, c in self._conv_shapes)
        return 2 * per_window * torch.finfo(self.dtype).bits // 8

    def acquire(self) -> int:
        with self.lock:
            if not self._free:
                self._grow(max(1, 2 * self.capacity))
            self.in_use += 1
            return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        with self.lock:
            heapq.heappush(self._free, slot)
            self.in_use -= 1

    def reserve(self, slots: int) -> None:
        with self.lock:
            if slots > self.capacity:
                self._grow(slots)

    @torch.inference_mode()
    def _grow(self, capacity: int) -> None:
        windows = 2 * (capacity + 2)
        try:
            kv = torch.zeros(windows, *self._kv_shape, dtype=self.dtype, device=self.device)
            tails = [torch.zeros(2 * windows, *t.shape[1:], dtype=self.dtype, device=self.device) for t in self.tails]
        except torch.OutOfMemoryError:
            raise CtxPoolFullError(
                f"too many answers being spoken at once: all {self.capacity} slots of the speech decoder's context "
                f"cache are in use, and {(capacity - self.capacity) * self.slot_bytes() / 2**30:.1f} GiB more GPU "
                "memory is not free") from None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every kernel queued over the old tensors has run
        n = 2 * self.capacity  # real slots' windows (the old spare and blank are not kept: blank must stay zeros)
        if n:
            kv[:n] = self.kv[:n]
            for new, old in zip(tails, self.tails, strict=True):
                new[:2 * n] = old[:2 * n]
        self.kv, self.tails = kv, tails
        self._free.extend(range(self.capacity, capacity))
        heapq.heapify(self._free)
        self.capacity = capacity
        self.generation += 1

    # ---- index arrays of a solve --------------------------------------------------------------------------------
    def index(self, slots: list[int], parities: list[int]) -> np.ndarray:
        """[B, 2 (branch), 3]: per window its kv row, the tail row it reads and the one it writes."""
        s = np.asarray(slots, dtype=np.int64)[:, None]
        p = np.asarray(parities, dtype=np.int64)[:, None]
        w = 2 * s + np.arange(2)[None]  # [B, 2]
        return np.stack([w, 2 * w + p, 2 * w + 1 - p], axis=2)

    def pad_index(self) -> np.ndarray:
        """The index rows [2, 3] of a padding session: the spare's windows (reads and writes nothing real)."""
        return self.index([self.spare], [0])[0]

    # ---- a voice's context ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def save(self, slot: int) -> VoiceContext:
        """A copy of the slot's rows (parity 0 for the tails)."""
        w = slice(2 * slot, 2 * slot + 2)
        return VoiceContext(self.kv[w].clone(), [t[4 * slot:4 * slot + 4:2].clone() for t in self.tails])

    @torch.inference_mode()
    def load(self, slot: int, ctx: VoiceContext) -> None:
        """The slot's rows (parity 0 for the tails) = ctx, on the current CUDA stream."""
        with self.lock:
            self.kv[2 * slot:2 * slot + 2] = ctx.kv
            for t, v in zip(self.tails, ctx.tails, strict=True):
                t[4 * slot:4 * slot + 4:2] = v


class StepCache:
    """The cache as one estimator call at Euler step `step` sees it: rows [3, N] (device, long; each row dense, as the
    CUDA kernels index them with stride 1) per window (in the estimator's batch order) its kv row, tail row read and
    tail row written (`columns`); `has_ctx` False for a voice's context pass (its frames have no context: keys of
    their own only, zeros before the first frame); `write_kv` False for a solve of fewer new frames than the context
    (an answer's last chunk: nothing follows it)."""

    def __init__(self, pool: CtxPool, step: int, rows: torch.Tensor, has_ctx: bool = True,
                 write_kv: bool = True) -> None:
        if rows.dim() != 2 or rows.shape[0] != 3 or rows.stride(1) != 1:
            raise ValueError(f"cache rows {tuple(rows.shape)} (strides {rows.stride()}) are not [3, N] with dense rows")
        self.pool, self.step, self.rows, self.has_ctx, self.write_kv = pool, step, rows, has_ctx, write_kv

    @staticmethod
    def columns(idx: torch.Tensor) -> torch.Tensor:
        """[N, 3] per-window index rows (CtxPool.index, windows in the estimator's order) -> [3, N] dense rows: one
        copy per solve, so that no kernel reads a strided column."""
        return idx.t().contiguous()

    def part(self, a: int, b: int) -> StepCache:
        """Windows a..b only (the estimator's chains side by side)."""
        return StepCache(self.pool, self.step, self.rows[:, a:b], self.has_ctx, self.write_kv)

    def attention(self, block) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv [windows, 2, ctx, HD] of this block and step, the windows' kv rows [N])."""
        return self.pool.kv[:, self.step, self.pool.block_index[id(block)]], self.rows[0]

    def conv(self, conv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tails [2 * windows, kernel - 1, Cin] of this conv and step, rows read [N], rows written [N])."""
        return self.pool.tails[self.pool.conv_index[id(conv)]][:, self.step], self.rows[1], self.rows[2]
