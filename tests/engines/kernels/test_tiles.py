"""The varlen attention kernel's tile list covers every new row of every prefill chunk exactly once."""

from __future__ import annotations

import random

import pytest

from engines.kernels.tiles import BLOCK_M, max_tiles, tile_map


def test_tiles_cover_each_prefill_row_once_and_pad():
    rng = random.Random(0)
    for _ in range(200):
        nd = rng.randint(0, 5)
        lens = [1] * nd + [rng.randint(1, 3 * BLOCK_M) for _ in range(rng.randint(1, 6))]
        pad = max_tiles(sum(lens), len(lens))
        seqs, firsts = tile_map(lens, nd, num_tiles=pad)
        assert len(seqs) == len(firsts) == pad
        covered = [(s, f + i) for s, f in zip(seqs, firsts, strict=True) if s >= 0
                   for i in range(BLOCK_M) if f + i < lens[s]]
        assert sorted(covered) == [(s, r) for s in range(nd, len(lens)) for r in range(lens[s])]
        n_real = sum(-(-n // BLOCK_M) for n in lens[nd:])
        assert seqs[n_real:] == [-1] * (pad - n_real) and -1 not in seqs[:n_real]


def test_too_few_tiles_is_an_error():
    with pytest.raises(ValueError, match="do not fit"):
        tile_map([3 * BLOCK_M], 0, num_tiles=2)
