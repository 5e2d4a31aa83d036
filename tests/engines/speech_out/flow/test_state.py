"""What the flow keeps between chunks: an answer's encoder keys grow a chunk at a time in place."""

from __future__ import annotations

import torch

from engines.speech_out.flow.state import GrowingKeys, key_groups


def test_growing_keys_hold_what_concatenating_every_chunk_gives():
    g = torch.Generator().manual_seed(0)
    keys = GrowingKeys(torch.zeros(3, 2, 0, 4, 8))
    want = torch.zeros(3, 2, 0, 4, 8)
    buffers = set()
    for m in (5, 5, 1, 7, 20, 5, 40, 5, 5):  # past several growths, one append longer than the buffer
        new = torch.randn(3, 2, m, 4, 8, generator=g)
        keys.append(new)
        want = torch.cat([want, new], dim=2)
        assert torch.equal(keys.value, want)
        buffers.add(keys.buf.data_ptr())
    assert keys.n == 93 and keys.buf.shape[2] >= 93
    assert len(buffers) == 3  # of 32, 64 and 96 keys: appends that fit copy only the chunk
    assert keys.nbytes() == keys.buf.numel() * 4


def test_key_groups_keep_one_group_when_the_batch_fits_and_else_pad_no_group_past_the_budget():
    lengths = [40, 300, 35, 2000, 60, 45]
    assert key_groups(lengths, 10, 6 * 2000 * 10) == [[2, 0, 5, 4, 1, 3]]  # all fit: one group, shortest first
    groups = key_groups(lengths, 10, 5 * 300 * 10)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
    assert groups == [[2, 0, 5, 4, 1], [3]]  # the long answer alone; the rest together, padded to 300
    for g in groups[:-1]:
        assert len(g) * max(lengths[i] for i in g) * 10 <= 5 * 300 * 10
    assert key_groups(lengths, 10, 2 * 45 * 10) == [[2, 0], [5], [4], [1], [3]]
    assert key_groups([], 10, 100) == []
