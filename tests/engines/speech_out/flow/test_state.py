"""What the flow keeps between chunks: an answer's encoder keys grow a chunk at a time in place."""

from __future__ import annotations

import torch

from engines.speech_out.flow.state import GrowingKeys


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
