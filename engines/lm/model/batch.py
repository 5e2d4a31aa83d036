"""What one forward pass of the serving model needs to know about its flattened rows.

The runner builds a `ForwardBatch` from the scheduled sequences; the model only reads it.
Rows of all sequences are concatenated: sequence i owns rows
`query_start[i]:query_start[i+1]` of the flat batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    rows: torch.Tensor  # [T, 2] long: (text token, audio token) per new row
    positions: torch.Tensor  # [T] long: absolute position of each new row in its sequence
    slot_mapping: torch.Tensor  # [T] long: KV slot (block * block_size + offset) each new row writes
    query_start: torch.Tensor  # [B+1] long (cumulative new rows per sequence, starts at 0)
    context_lens: torch.Tensor  # [B] long: cached + new rows per sequence after this pass
    block_tables: torch.Tensor  # [B, max_blocks] long: padded with 0 past each sequence's blocks
    logits_rows: torch.Tensor  # [R] long: flat row indices whose logits are needed (usually each seq's last)
    max_query_len: int  # host copies of the maxima, so kernels need no device sync
    max_context_len: int
    is_decode: bool = False  # every sequence has exactly one new row
    # Sequences 0..num_decode_seqs-1 have one new row each (the runner puts them first), so a
    # decode kernel can take them together; the rest are prefill chunks.
    num_decode_seqs: int = 0
    query_start_host: list[int] | None = None  # host copies, so prefill never syncs to read them
    context_lens_host: list[int] | None = None
    # [2, n_tiles] long: (sequence, first new row) of each prefill tile, padded with sequence -1
    # (engines/kernels/lm/paged_prefill.py); None for decode-only batches and on the CPU path.
    tiles: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
