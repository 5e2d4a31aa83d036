"""CUDA graphs of the full-context flow (`full_context.py`): its Euler solve and its encoder.

Neither's shapes depend on how long the answers of a round are (the solve's attention reads each row's pages in place
up to its own length, the encoder's each answer's keys in place), so one graph of a batch serves answers anywhere in
them. A round of playing answers replays graphs captured at load for every batch up to the largest, in quarter steps
from 16 (`FINE_BUCKETS`: a round is padded by at most a quarter of its rows, and padded rows do a real row's work);
answers' first jobs, a few at a time, in powers of two up to FIRST_JOB_BATCH.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.speech_out.chunk_graphs import FINE_BUCKETS, BucketGraphs, buckets_up_to
from engines.speech_out.flow.full_context import FIRST_JOB_BATCH, PAGES_BUCKET, FullContextFlow


class FullSolveGraphs(BucketGraphs):
    """`FullContextFlow.euler` of whole chunks as CUDA graphs, one per (batch bucket, chunks, table width: `graph_
    pages`). Rows padded by repeating the last one write that row's pages again with the same values."""

    def __init__(self, full: FullContextFlow, urgent: bool = False) -> None:
        super().__init__(full.euler, urgent)
        self.full = full

    @torch.inference_mode()  # as run_jobs: no autograd state in the captured solve
    def capture_steady_state(self, max_batch: int, max_pages: int, first_jobs: Sequence[tuple[int, int]] = ()
                             ) -> int:
        """Capture now the graphs of one chunk for every batch bucket up to `max_batch` and table width up to
        `max_pages` earlier pages, and for each (chunks, pages read) of `first_jobs`, those of answers' first jobs of
        that many chunks (batch buckets up to FIRST_JOB_BATCH: first jobs come a few at a time). Returns how many
        were newly captured."""
        full = self.full
        page = full.pages.alloc(1)  # the captures' warm-up runs write one page
        n = 0
        try:
            widths = sorted({full.graph_pages(p) for p in range(PAGES_BUCKET, max_pages + PAGES_BUCKET, PAGES_BUCKET)},
                            reverse=True)  # largest first, as buckets_up_to
            for B in buckets_up_to(max_batch, FINE_BUCKETS):
                for maxp in widths:
                    n += self.ensure(self._inputs(B, 1, maxp, page[0]))
            for c, pages in first_jobs:
                for B in buckets_up_to(min(max_batch, FIRST_JOB_BATCH)):
                    n += self.ensure(self._inputs(B, c, full.graph_pages(pages), page[0]))
        finally:
            self.full.pages.release(page)
        return n

    def _inputs(self, B: int, c: int, maxp: int, page: int) -> list[torch.Tensor]:
        """`FullContextFlow.euler`'s inputs for B rows of c chunks reading maxp pages, writing `page` (values are
        replaced at every replay)."""
        full, f = self.full, self.full.flow
        cfg, dev, dt = f.cfg, f.device, f.dtype
        Fr, Lc = c * full.page_frames, full.left_channels

        def z(*shape, dtype=dt):
            return torch.zeros(*shape, device=dev, dtype=dtype)
        return [z(B, cfg.output_size, Fr), z(B, cfg.output_size, Fr), z(B, cfg.output_size, Fr),
                z(B, cfg.output_size), z(B, cfg.n_timesteps, 2, Lc, 2, dtype=full.est_dtype),
                z(B, maxp, dtype=torch.long), z(B, dtype=torch.long),
                torch.full((B, c), page, device=dev, dtype=torch.long),
                torch.full((B,), Fr, device=dev, dtype=torch.long)]


class FullEncoderGraphs(BucketGraphs):
    """`FullContextFlow.encode_rows` as CUDA graphs, one per (batch bucket, codes of the job). Captured on first use
    until `capture_steady_state` has run; after it, jobs of other sizes (an answer's last, partial chunk) run eagerly.
    Rows padded by repeating the last one read that row's keys again."""

    def __init__(self, full: FullContextFlow, urgent: bool = False) -> None:
        super().__init__(full.encode_rows, urgent)
        self.full = full
        self.frozen = False

    def may_capture(self) -> bool:
        return not self.frozen

    @torch.inference_mode()  # as run_jobs
    def capture_steady_state(self, max_batch: int, first_jobs: Sequence[int] = ()) -> int:
        """Capture now the graphs of one chunk for every batch up to `max_batch` and, for each count of codes in
        `first_jobs`, those of answers' first jobs (batches up to FIRST_JOB_BATCH). Returns how many were newly
        captured."""
        n = sum(self.ensure(self._inputs(B, self.full.chunk)) for B in buckets_up_to(max_batch, FINE_BUCKETS))
        for codes in first_jobs:
            n += sum(self.ensure(self._inputs(B, codes)) for B in buckets_up_to(min(max_batch, FIRST_JOB_BATCH)))
        self.frozen = True
        return n

    def _inputs(self, B: int, n: int) -> list[torch.Tensor]:
        """`encode_rows`' inputs for B rows of n codes (values are replaced at every replay; a table of zeros: no
        earlier keys)."""
        f = self.full.flow
        cfg, dev = f.cfg, f.device
        r, la, D = cfg.token_mel_ratio, cfg.pre_lookahead, cfg.d_model
        idx = {"device": dev, "dtype": torch.long}
        return [torch.zeros(B, n + la, **idx), torch.ones(B, n + la, device=dev, dtype=torch.bool),
                torch.zeros(B, 2, D, device=dev, dtype=f.dtype), torch.zeros(B, 2 * r, D, device=dev, dtype=f.dtype),
                torch.arange(n, **idx).repeat(B, 1), torch.arange(n * r, **idx).repeat(B, 1),
                torch.zeros(B, 6, **idx), torch.zeros(B, 6, **idx)]
