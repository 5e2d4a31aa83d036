"""KV cache slots for encoder streams: one fixed-size slot per open stream, shared tensors per layer, and each
stream's carried state between steps in slot-indexed tensors too.

Each layer holds keys and values as [slots, heads, max_source_positions, head_dim], so one step can
write the new rows of all streams with one indexed store and attend with one batched call (a view,
not a copy, when the streams of the step hold consecutive slots; lowest free slots are handed out first
to make that the common case). A slot is 1500 rows x 2 x d_model per layer: 234 MiB per stream at full
size in float32, the encoder's dtype (16 layers; `slot_bytes`). The pool doubles when full; freed slots are reused.

`held_back` of the slots (`reserve(..., held_back=)`) go only to re-encodes (segment_floor.py): a turn answered early
keeps its stream while its codes are made again with the whole-segment floor, so on a server where every slot holds a
speaking user's stream the re-encode would otherwise find none.

One more slot than the capacity is allocated: `spare`, never handed out, takes the K/V writes of padding tokens
(a step's streams padded to the same number of new frames, or to a CUDA graph's bucket). A growth reallocates every
tensor, so `generation` counts them: graphs captured over the old tensors must not be replayed.

The carried state (`mel_tail`, `h1_tail`, `pool`, `peaks`; rows of slot s at s, the spare's at `spare`) has one more
row, `blank`, never written: a stream's state before its first step (zeros; the peak -inf). A step reads each stream's
state rows and writes them back by index, so the whole step is a fixed sequence of kernels over index arrays: one CUDA
graph can hold it (step_graphs.py), and no per-stream tensor is made, freed or handed between CUDA streams.
"""

from __future__ import annotations

import heapq

import torch

from engines.api import EngineError
from engines.protocol import errors
from engines.speech_in.config import EncoderConfig


class PoolFullError(EngineError):
    """Every slot is taken and the GPU has no memory to grow the pool: the stream that asked fails, not the engine.
    (The pool is reserved at start for --max-running streams; more users may speak at once than that.)"""

    code = errors.SERVER_BUSY


class KVPool:
    def __init__(self, cfg: EncoderConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [slots, heads, positions, head_dim]
        self.values: list[torch.Tensor] = []
        k = cfg.pooling_kernel_size
        self.mel_tail = torch.zeros(2, 2, cfg.num_mel_bins, dtype=dtype, device=device)  # [slots + 2, 2, n_mels]
        self.h1_tail = torch.zeros(2, 2, cfg.d_model, dtype=dtype, device=device)  # [slots + 2, 2, d] conv1 outputs
        self.pool = torch.zeros(2, k - 1, cfg.d_model, dtype=dtype, device=device)  # [slots + 2, k - 1, d]
        self.peaks = torch.full((2,), float("-inf"), device=device)  # [slots + 2] running log-mel max
        self._free: list[int] = []
        self.in_use = 0
        self.held_back = 0  # free slots only re-encodes may take
        self.generation = 0  # growths so far

    @property
    def spare(self) -> int:
        """The slot padding tokens write to (the row after the last real slot)."""
        return self.capacity

    @property
    def blank(self) -> int:
        """The state row never written: a fresh stream's carried state."""
        return self.capacity + 1

    def has_free(self, reencode: bool = False) -> bool:
        """A slot can be handed out without a growth (to a re-encode: one held back too)."""
        return len(self._free) > (0 if reencode else self.held_back)

    def acquire(self, reencode: bool = False) -> int:
        if not self.has_free(reencode):
            self._grow(max(1, 2 * self.capacity))
        self.in_use += 1
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
        self.in_use -= 1

    def state(self) -> list[torch.Tensor]:
        """The carried state's tensors other than the peaks (each [slots + 2, rows, width])."""
        return [self.mel_tail, self.h1_tail, self.pool]

    def slot_bytes(self) -> int:
        """Keys and values of one stream over every layer."""
        cfg = self.cfg
        per_layer = cfg.num_heads * cfg.max_source_positions * cfg.head_dim * torch.finfo(self.dtype).bits // 8
        return 2 * cfg.num_layers * per_layer

    def reserve(self, slots: int, held_back: int = 0) -> None:
        """Allocate room for `slots` streams up front (avoids growth copies while serving), and `held_back` more
        slots for re-encodes only."""
        if slots + held_back > self.capacity:
            self._grow(slots + held_back)
        self.held_back = held_back

    def _grow(self, capacity: int) -> None:
        """All new tensors first, then the copy: a growth that runs out of memory changes nothing (the CUDA graphs
        hold the old tensors, which must not be freed while they are still the pool's)."""
        cfg = self.cfg
        shape = (capacity + 1, cfg.num_heads, cfg.max_source_positions, cfg.head_dim)  # + the spare slot
        try:
            # Zeros, not empty: masked-out rows still enter the weighted sum (as 0 x value), NaN garbage would not.
            keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
            values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
            state = [torch.zeros(capacity + 2, *t.shape[1:], dtype=t.dtype, device=t.device) for t in self.state()]
            peaks = torch.full((capacity + 2,), float("-inf"), device=self.device)
        except torch.OutOfMemoryError:
            raise PoolFullError(
                f"too many streams speaking at once: all {self.capacity} of the speech encoder's KV slots are in use, "
                f"and growing the pool to {capacity} needs {(capacity - self.capacity) * self.slot_bytes() / 2**30:.1f}"
                " GiB more GPU memory than is free") from None
        if self.capacity:
            for new, old in zip(keys + values + state + [peaks], self.keys + self.values + self.state() + [self.peaks],
                                strict=True):
                new[: self.capacity] = old[: self.capacity]
        self.keys, self.values = keys, values
        self.mel_tail, self.h1_tail, self.pool = state
        self.peaks = peaks
        if self.device.type == "cuda":
            # Made on whichever stream the caller is on (a stream's opening, outside any encoder call); the encoder's
            # own streams read them next, without an event between: wait here (growths are rare, beyond the reserve).
            torch.cuda.current_stream(self.device).synchronize()
        self._free.extend(range(self.capacity, capacity))
        heapq.heapify(self._free)
        self.capacity = capacity
        self.generation += 1
