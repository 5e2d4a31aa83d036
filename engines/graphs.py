"""CUDA graphs for decode steps over a ladder of batch sizes.

A decode step (one new row per sequence) has static shapes once the batch is padded to a
ladder size, so the whole model forward plus the audio head is captured once per size and
replayed: one launch instead of ~40 layers x ~15 kernels. Padding rows write their K/V into a
spare block outside the pool and attend only to it, so they never touch real sequences.
"""

from __future__ import annotations

import torch

from engines.model.batch import ForwardBatch

LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


class CudaGraphDecoder:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_batch: int, max_blocks_per_seq: int,
                 pad_block: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = [b for b in LADDER if b < max_batch] + [max_batch]
        self.pad_block = pad_block
        self.block_size = kv_cache.shape[3]
        dev = kv_cache.device
        n = self.sizes[-1]
        long = dict(dtype=torch.long, device=dev)
        self.rows = torch.zeros(n, 2, **long)
        self.positions = torch.zeros(n, **long)
        self.slots = torch.zeros(n, **long)
        self.context_lens = torch.ones(n, **long)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **long)
        self.logits_rows = torch.arange(n, **long)
        self.query_start = torch.arange(n + 1, **long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # memory pool of the captured graphs, shared with CudaGraphMixed
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            rows=self.rows[:b], positions=self.positions[:b], slot_mapping=self.slots[:b],
            query_start=self.query_start[: b + 1], context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b], logits_rows=self.logits_rows[:b], max_query_len=1,
            max_context_len=self.block_tables.shape[1] * self.block_size, is_decode=True, num_decode_seqs=b,
        )

    def _reset_padding(self, start: int) -> None:
        self.rows[start:] = 0
        self.positions[start:] = 0
        self.slots[start:] = self.pad_block * self.block_size
        self.context_lens[start:] = 1
        self.block_tables[start:] = self.pad_block

    def _run(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self._batch(b), self.kv_cache)  # [2, b, hidden]
        return hidden, self.model.audio_logits(hidden[1])

    @torch.inference_mode()
    def capture(self) -> None:
        self._reset_padding(0)
        self.pool = pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                for _ in range(2):  # warm-up compiles the Triton kernels outside the capture
                    self._run(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[b] = self._run(b)
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a decode batch through the graph of the next ladder size: (hidden [2, n, h], audio_logits [n, A])."""
        n = batch.num_seqs
        b = self.bucket(n)
        self.rows[:n].copy_(batch.rows, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slots[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(batch.context_lens, non_blocking=True)
        width = batch.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        if b > n:
            self._reset_padding(n)
        self.graphs[b].replay()
        hidden, audio_logits = self.outputs[b]
        return hidden[:, :n], audio_logits[:n]


ROW_LADDER = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


class CudaGraphMixed:
    """CUDA graphs for steps that run prefill chunks (with or without decode rows), one per (padded rows,
    padded sequences), captured on first use.

    Eagerly, such a step is ~40 layers x ~20 launches of host work (20-40 ms for 512 rows against ~14 ms of
    GPU time). Attention is the varlen tile kernel plus the decode kernel over every sequence
    (engines/kernels/attention_gpu.py), so the shapes depend only on the padding. Padding rows write their
    K/V into the spare block; padding sequences have no rows and no tiles.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_rows: int, max_seqs: int,
                 max_blocks_per_seq: int, pad_block: int, pool) -> None:
        from engines.kernels.tiles import max_tiles

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

    def key(self, num_rows: int, num_seqs: int) -> tuple[int, int] | None:
        t = next((x for x in self.row_sizes if x >= num_rows), None)
        b = next((x for x in self.seq_sizes if x >= num_seqs), None)
        return None if t is None or b is None else (t, b)

    def _batch(self, t: int, b: int) -> tuple[ForwardBatch, int]:
        from engines.kernels.tiles import max_tiles

        n = max_tiles(t, b)
        return ForwardBatch(
            rows=self.rows[:t], positions=self.positions[:t], slot_mapping=self.slots[:t],
            query_start=self.query_start[: b + 1], context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b], logits_rows=self.logits_rows[:b], max_query_len=t,
            max_context_len=self.block_tables.shape[1] * self.kv_cache.shape[3], is_decode=False,
            num_decode_seqs=0, tiles=self.tiles[:, :n]), n

    def _run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(batch, self.kv_cache)  # [2, b, hidden]
        return hidden, self.model.audio_logits(hidden[1])

    def _load(self, batch: ForwardBatch, t: int, b: int, n_tiles: int) -> None:
        """Copy the real batch into the static buffers and pad it to (t rows, b sequences, n_tiles tiles)."""
        nt, nb = batch.num_rows, batch.num_seqs
        self.rows[:nt].copy_(batch.rows, non_blocking=True)
        self.positions[:nt].copy_(batch.positions, non_blocking=True)
        self.slots[:nt].copy_(batch.slot_mapping, non_blocking=True)
        self.rows[nt:t] = 0
        self.positions[nt:t] = 0
        self.slots[nt:t] = self.pad_slot
        self.query_start[: nb + 1].copy_(batch.query_start, non_blocking=True)
        self.query_start[nb + 1: b + 1] = nt
        self.context_lens[:nb].copy_(batch.context_lens, non_blocking=True)
        self.context_lens[nb:b] = 1
        width = batch.block_tables.shape[1]
        self.block_tables[:nb, :width].copy_(batch.block_tables, non_blocking=True)
        self.block_tables[nb:b] = self.pad_block
        r = batch.logits_rows.shape[0]
        self.logits_rows[:r].copy_(batch.logits_rows, non_blocking=True)
        self.logits_rows[r:b] = 0
        k = batch.tiles.shape[1]
        tiles = self.tiles[:, :n_tiles]
        tiles[:, :k].copy_(batch.tiles, non_blocking=True)
        tiles[0, k:] = -1

    def _capture(self, t: int, b: int, static: ForwardBatch) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: compiles kernels and settles the allocator outside the capture
                self._run(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._run(static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs[(t, b)] = (graph, out)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (rows, sequences) size up front, on an all-padding batch (writes only the spare
        block), so no user's step pays a capture."""
        for t in self.row_sizes:
            for b in self.seq_sizes:
                if b > t or (t, b) in self.graphs:
                    continue
                static, n_tiles = self._batch(t, b)
                self.rows[:t] = 0
                self.positions[:t] = 0
                self.slots[:t] = self.pad_slot
                self.query_start[: b + 1] = 0
                self.context_lens[:b] = 1
                self.block_tables[:b] = self.pad_block
                self.logits_rows[:b] = 0
                self.tiles[0, :n_tiles] = -1
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
