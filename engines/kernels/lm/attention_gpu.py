"""CUDA attention over the paged cache: Triton split-KV kernel for decode rows, Triton varlen tiles for
prefill chunks (engines/kernels/lm/paged_prefill.py).

Decode rows come first in the batch (the runner orders them). Neither kernel needs a host sync or a
per-sequence launch, so decode steps and mixed prefill steps can both be captured in CUDA graphs.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from engines.kernels.lm.paged_decode import paged_decode_attention
from engines.kernels.lm.paged_prefill import paged_varlen_attention
from engines.kernels.tiles import tile_map
from engines.lm.model.batch import ForwardBatch


def paged_attention_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                         scale: float | None = None) -> torch.Tensor:
    t, heads, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    b = batch.num_seqs
    if batch.num_decode_seqs == b:
        return paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale)
    # The decode kernel takes every sequence's row at its index (right for the decode rows, which come
    # first; scratch for the others), then the tiles rewrite all rows of the prefill chunks. Both launches
    # have shapes fixed by the padded batch, so a mixed step can be captured in a CUDA graph.
    q = q.contiguous()
    out = torch.empty_like(q)
    out[:b] = paged_decode_attention(q[:b], k_cache, v_cache, batch.block_tables, batch.context_lens, scale)
    tiles = batch.tiles
    if tiles is None:
        lens = [hi - lo for lo, hi in pairwise(batch.query_start_host)]
        tiles = torch.tensor(tile_map(lens, batch.num_decode_seqs), dtype=torch.long).to(q.device)
    return paged_varlen_attention(q, k_cache, v_cache, tiles, batch.query_start, batch.positions, batch.context_lens,
                                  batch.block_tables, scale, out)
