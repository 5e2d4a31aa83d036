"""CUDA graphs for decode steps over a ladder of batch sizes.

A decode step (one new row per sequence) has static shapes once the batch is padded to a
ladder size, so the whole model forward plus the audio head is captured once per size and
replayed: one launch instead of ~40 layers x ~15 kernels. Padding rows write their K/V into a
spare block outside the pool and attend only to it, so they never touch real sequences.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

from engines.cuda.streams import driver_stream, level, side_by_side
from engines.kernels.tiles import max_tiles
from engines.lm.model.batch import ForwardBatch

INPUT_WORDS = 6  # int64 words per row of a decode graph's inputs: (text, audio), position, slot, context, history slot
LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)

T = TypeVar("T")


def private_stream(device: torch.device | str | None = None, urgent: bool | None = None) -> torch.cuda.ExternalStream:
    """A CUDA stream that is nobody else's: made by the driver, outside PyTorch's stream pool, and never freed
    (engines.cuda.streams.driver_stream). `urgent`: the most urgent priority, else the least; None: the current stream's
    priority.

    A graph's kernels keep the priority of the stream they were captured on, whatever stream replays them (H200:
    the codec's batch-1 solve graph beside a GEMM load took 24.2 ms captured on an urgent stream and 38.2 captured
    on a low one, replayed on either; 2026-11-25). So each owner captures on a stream
    of the priority its replays are meant to have, and side streams made inside a capture take the capture's.

    Graphs are captured on such streams because cuBLAS work takes the workspace PyTorch keys by (handle, stream),
    and a captured GEMM keeps that workspace's address for every replay. Pool streams come round-robin (32 per
    priority), so two graph sets captured on pool streams, or a graph and eager work on a pool stream, could share
    one workspace while running at the same time on different streams: a split-K GEMM's partial sums and
    semaphores are then overwritten by the other's, which reads wrong values or spins forever (a GPU hang).
    Destroying a graph also drops its capture stream's workspaces, which
    would pull them from under the live graphs of another owner of the same pool stream."""
    if urgent is None:
        return driver_stream(device, level=level(torch.cuda.current_stream(device)))
    return driver_stream(device, urgent=urgent)


class SideStreams:
    """Private streams (`private_stream`) for the branches an owner forks inside its graphs, made at first use: one
    set per priority, each branch at its fork's priority (a captured branch keeps its stream's priority)."""

    def __init__(self) -> None:
        self._sets: dict[int, list[torch.cuda.ExternalStream]] = {}  # by priority level (engines.cuda.streams.level)

    def get(self, device: torch.device | str, n: int) -> list[torch.cuda.ExternalStream]:
        """n streams of the current stream's priority."""
        streams = self._sets.setdefault(level(torch.cuda.current_stream(device)), [])
        while len(streams) < n:
            streams.append(private_stream(device))
        return streams[:n]

    def all(self) -> list[torch.cuda.ExternalStream]:
        return [s for streams in self._sets.values() for s in streams]


def capture_graph(fn: Callable[[], T], stream: torch.cuda.Stream, pool=None, warmup: int = 2
                  ) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` `warmup` times on `stream` (lazy inits, Triton compiles and allocator state stay out of the
    graph), then capture it there into `pool`. Returns the graph and the outputs it writes on replay.
    `stream` is the owner's `private_stream`: only graphs that never run at the same time may share one.
    The capture restricts only its own thread ("thread_local"): in CUDA's default (global) mode a capture is
    invalidated by any other thread's CUDA call that could synchronise (an allocation, an event wait), and the
    engine process's other threads (the loop's steps, the codec's lanes, the speech encoder) never stop for one."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: a cycle it frees may hold CUDA graphs whose memory pool then goes
        # back to the device (a cudaFree, which invalidates the capture); seen as "operation failed due to a previous
        # error during capture" on a capture after another encoder's graphs were dropped.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                out = fn()
        finally:
            if collecting:
                gc.enable()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def _forward(model: torch.nn.Module, kv_cache: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model(batch, kv_cache)  # [2, b, hidden]
    return hidden, model.audio_logits(hidden[1])


class CudaGraphDecoder:
    """Decode graphs over the batch ladder, with their inputs in one device buffer `io`.

    For a graph of b rows, `io` starts with its inputs, padded to b rows: rows [b, 2], positions, KV slots, context
    lengths and history slots [b] each. The rest of the step's uploads follow them (`stage`: the sampling columns,
    and the block tables when they changed), so a step's inputs reach the device in one host-to-device copy and the
    graph reads them where they land. Block tables (width up to the model length) stay in their own static buffer:
    they are copied there only when they changed, which for a decoding sequence is once every block.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_batch: int, max_blocks_per_seq: int,
                 pad_block: int, mark_history: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 spare_slot: int = 0) -> None:
        """mark_history(rows [b, 2], slots [b]): the step's update of the repetition histories, captured with the
        forward pass; padding rows mark `spare_slot`."""
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = [b for b in LADDER if b < max_batch] + [max_batch]
        self.pad_block = pad_block
        self.block_size = kv_cache.shape[3]
        self.mark_history, self.spare_slot = mark_history, spare_slot
        dev = kv_cache.device
        n = self.sizes[-1]
        # inputs, then sampling columns (8 ints, 6 floats as 3 words, a logits row), then staged block tables
        self.io = torch.zeros(n * (INPUT_WORDS + 12 + max_blocks_per_seq), dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.long, device=dev)
        self.logits_rows = torch.arange(n, dtype=torch.long, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.long, device=dev)
        self._tables: tuple | None = None  # (b, width, tables) last copied into block_tables
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # memory pool of the captured graphs, shared with CudaGraphMixed
        self.stream = private_stream(dev)  # every graph's capture stream (and so its cuBLAS workspace)
        self.side_stream = private_stream(dev)  # the history update's branch
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _inputs(self, b: int) -> tuple[torch.Tensor, ...]:
        """Views of the inputs of the b-row graph in `io`: rows [b, 2], positions, slots, context lengths, history
        slots [b]."""
        rows, pos, slots, ctx, hist = torch.split(self.io[: INPUT_WORDS * b], [2 * b, b, b, b, b])
        return rows.view(b, 2), pos, slots, ctx, hist

    def _batch(self, b: int) -> ForwardBatch:
        rows, pos, slots, ctx, _ = self._inputs(b)
        return ForwardBatch(
            rows=rows, positions=pos, slot_mapping=slots, query_start=self.query_start[: b + 1], context_lens=ctx,
            block_tables=self.block_tables[:b], logits_rows=self.logits_rows[:b], max_query_len=1,
            max_context_len=self.block_tables.shape[1] * self.block_size, is_decode=True, num_decode_seqs=b,
        )

    def _step(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._batch(b)
        if self.mark_history is None:
            return _forward(self.model, self.kv_cache, batch)
        # The history update only has to be done before the sampler, after the graph: a branch of its own that
        # runs beside the layers instead of before the first one.
        hist = self._inputs(b)[4]
        return side_by_side([self.side_stream], lambda: _forward(self.model, self.kv_cache, batch),
                            lambda: self.mark_history(batch.rows, hist))[0]

    def _padded_inputs(self, b: int, rows: list[int], positions: list[int], slots: list[int], ctx: list[int],
                       hist: list[int]) -> list[int]:
        """The b-row graph's input words for n real rows: padding rows write the spare block and attend to it
        only, and mark the spare history slot."""
        p = b - len(positions)
        return (rows + [0] * (2 * p) + positions + [0] * p + slots + [self.pad_block * self.block_size] * p
                + ctx + [1] * p + hist + [self.spare_slot] * p)

    @torch.inference_mode()
    def capture(self) -> None:
        self.block_tables.fill_(self.pad_block)
        self._tables = None
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            # all padding, in this graph's layout: the warm-up runs write only the spare block and history slot
            self.io[: INPUT_WORDS * b].copy_(torch.tensor(self._padded_inputs(b, [], [], [], [], [])))
            self.graphs[b], self.outputs[b] = capture_graph(lambda b=b: self._step(b), self.stream, self.pool)
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def stage(self, rows: list[int], positions: list[int], slots: list[int], context_lens: list[int],
              history_slots: list[int], tables: list[list[int]], extra: list[int]) -> torch.Tensor:
        """Put a decode step of n = len(positions) sequences on the device in one host-to-device copy: the inputs of
        its graph (rows as 2n flat words), `extra` words after them, and the block tables when they differ from the
        last step's. Returns the device copy of `extra` (valid until the next step is staged)."""
        n = len(positions)
        b = self.bucket(n)
        width = max(len(t) for t in tables)
        words = self._padded_inputs(b, rows, positions, slots, context_lens, history_slots) + extra
        tables_at = len(words)
        new_tables = (b, width, tables) != self._tables
        if new_tables:  # padding rows read the spare block
            for t in tables:
                words += t + [0] * (width - len(t))
            words += [self.pad_block] * (width * (b - n))
        self.io[: len(words)].copy_(torch.tensor(words, dtype=torch.long).pin_memory(), non_blocking=True)
        if new_tables:
            self.block_tables[:b, :width].copy_(self.io[tables_at: tables_at + b * width].view(b, width))
            self._tables = (b, width, tables)
        return self.io[INPUT_WORDS * b: tables_at]

    def set_audio_codes(self, codes: torch.Tensor) -> None:
        """Rows (modality pad, code) whose codes [n] are on the device: staged with code 0, the codes copied in."""
        self.io[: 2 * codes.shape[0]].view(-1, 2)[:, 1].copy_(codes)

    def replay_staged(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph of the staged step: (hidden [2, n, h], audio_logits [n, A])."""
        b = self.bucket(n)
        self.graphs[b].replay()
        hidden, audio_logits = self.outputs[b]
        return hidden[:, :n], audio_logits[:n]


ROW_LADDER = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


class CudaGraphMixed:
    """CUDA graphs for steps that run prefill chunks (with or without decode rows), one per (padded rows,
    padded sequences), captured on first use.

    Eagerly, such a step is ~40 layers x ~20 launches of host work (20-40 ms for 512 rows against ~14 ms of
    GPU time). Attention is the varlen tile kernel plus the decode kernel over every sequence
    (engines/kernels/lm/attention_gpu.py), so the shapes depend only on the padding. Padding rows write their
    K/V into the spare block; padding sequences have no rows and no tiles.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_rows: int, max_seqs: int,
                 max_blocks_per_seq: int, pad_block: int, pool) -> None:
        self.model, self.kv_cache, self.pool = model, kv_cache, pool
        self.row_sizes = [t for t in ROW_LADDER if t < max_rows] + [max_rows]
        self.seq_sizes = [b for b in LADDER if b < max_seqs] + [max_seqs]
        self.pad_slot = pad_block * kv_cache.shape[3]
        self.pad_block = pad_block
        dev = kv_cache.device
        long = dict(dtype=torch.long, device=dev)
        t, b = self.row_sizes[-1], self.seq_sizes[-1]
        self.rows = torch.zeros(t, 2, **long)
        self.positions = torch.zeros(t, **long)
        self.slots = torch.zeros(t, **long)
        self.query_start = torch.zeros(b + 1, **long)
        self.context_lens = torch.ones(b, **long)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, **long)
        self.logits_rows = torch.zeros(b, **long)
        self.tiles = torch.zeros(2, max_tiles(t, b), **long)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.stream = private_stream(dev)

    def key(self, num_rows: int, num_seqs: int) -> tuple[int, int] | None:
        t = next((x for x in self.row_sizes if x >= num_rows), None)
        b = next((x for x in self.seq_sizes if x >= num_seqs), None)
        return None if t is None or b is None else (t, b)

    def _batch(self, t: int, b: int) -> tuple[ForwardBatch, int]:
        n = max_tiles(t, b)
        return ForwardBatch(
            rows=self.rows[:t], positions=self.positions[:t], slot_mapping=self.slots[:t],
            query_start=self.query_start[: b + 1], context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b], logits_rows=self.logits_rows[:b], max_query_len=t,
            max_context_len=self.block_tables.shape[1] * self.kv_cache.shape[3], is_decode=False,
            num_decode_seqs=0, tiles=self.tiles[:, :n]), n

    def _pad(self, t: int, b: int, n_tiles: int, rows: int = 0, seqs: int = 0, logits: int = 0, tiles: int = 0
             ) -> None:
        """Fill the static buffers past the real rows, sequences, logits rows and tiles with padding, up to
        (t rows, b sequences, n_tiles tiles): padding rows write the spare block, padding sequences have no rows."""
        self.rows[rows:t] = 0
        self.positions[rows:t] = 0
        self.slots[rows:t] = self.pad_slot
        self.query_start[seqs + 1: b + 1] = rows
        self.context_lens[seqs:b] = 1
        self.block_tables[seqs:b] = self.pad_block
        self.logits_rows[logits:b] = 0
        self.tiles[0, tiles:n_tiles] = -1

    def _load(self, batch: ForwardBatch, t: int, b: int, n_tiles: int) -> None:
        """Copy the real batch into the static buffers and pad it to (t rows, b sequences, n_tiles tiles)."""
        nt, nb, r, k = batch.num_rows, batch.num_seqs, batch.logits_rows.shape[0], batch.tiles.shape[1]
        self.rows[:nt].copy_(batch.rows, non_blocking=True)
        self.positions[:nt].copy_(batch.positions, non_blocking=True)
        self.slots[:nt].copy_(batch.slot_mapping, non_blocking=True)
        self.query_start[: nb + 1].copy_(batch.query_start, non_blocking=True)
        self.context_lens[:nb].copy_(batch.context_lens, non_blocking=True)
        self.block_tables[:nb, :batch.block_tables.shape[1]].copy_(batch.block_tables, non_blocking=True)
        self.logits_rows[:r].copy_(batch.logits_rows, non_blocking=True)
        self.tiles[:, :k].copy_(batch.tiles, non_blocking=True)
        self._pad(t, b, n_tiles, nt, nb, r, k)

    def _capture(self, t: int, b: int, static: ForwardBatch) -> None:
        self.graphs[(t, b)] = capture_graph(lambda: _forward(self.model, self.kv_cache, static), self.stream, self.pool)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (rows, sequences) size up front, on an all-padding batch (writes only the spare
        block), so no user's step pays a capture."""
        for t in self.row_sizes:
            for b in self.seq_sizes:
                if b > t or (t, b) in self.graphs:
                    continue
                static, n_tiles = self._batch(t, b)
                self.query_start[0] = 0
                self._pad(t, b, n_tiles)
                self._capture(t, b, static)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [2, R, h], audio_logits [R, A]) of a batch with prefill chunks; it must fit (`key`)."""
        t, b = self.key(batch.num_rows, batch.num_seqs)
        static, n_tiles = self._batch(t, b)
        self._load(batch, t, b, n_tiles)
        if (t, b) not in self.graphs:  # warm-up runs the real batch: it rewrites the same K/V
            self._capture(t, b, static)
        graph, (hidden, audio_logits) = self.graphs[(t, b)]
        graph.replay()
        r = batch.logits_rows.shape[0]
        return hidden[:, :r], audio_logits[:r]
