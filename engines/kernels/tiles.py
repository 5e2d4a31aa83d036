"""How the varlen attention kernel (engines/kernels/lm/paged_prefill.py) splits prefill rows into tiles.

Plain Python: the runner builds the tile list on every device, the kernel itself is GPU only.
"""

from __future__ import annotations

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per inner step


def tile_map(query_lens: list[int], first_seq: int = 0, num_tiles: int | None = None) -> list[list[int]]:
    """[[sequence per tile], [first row per tile]] covering the new rows of sequences first_seq.. (their
    new-row counts in query_lens), padded with sequence -1 up to num_tiles."""
    seqs, rows = [], []
    for i in range(first_seq, len(query_lens)):
        for r0 in range(0, query_lens[i], BLOCK_M):
            seqs.append(i)
            rows.append(r0)
    if num_tiles is not None:
        if num_tiles < len(seqs):
            raise ValueError(f"{len(seqs)} tiles do not fit in {num_tiles}")
        pad = num_tiles - len(seqs)
        seqs += [-1] * pad
        rows += [0] * pad
    return [seqs, rows]


def max_tiles(num_rows: int, num_seqs: int) -> int:
    """Most tiles `num_rows` new rows over `num_seqs` sequences can need."""
    return num_seqs + num_rows // BLOCK_M
