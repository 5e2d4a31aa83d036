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
        pool = torch.cuda.graph_pool_handle()
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
