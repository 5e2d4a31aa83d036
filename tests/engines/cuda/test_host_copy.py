"""engines/cuda/host_copy.py: index arrays to a device in one copy."""

import numpy as np
import pytest
import torch

from engines.cuda.host_copy import PinnedMirror, upload


def test_upload_gives_each_array_in_its_shape():
    a, b = np.arange(6).reshape(2, 3), np.array([True, False])
    ta, tb = upload([a, b], torch.device("cpu"))
    assert ta.shape == (2, 3) and tb.shape == (2,) and ta.dtype == tb.dtype == torch.int64
    assert ta.tolist() == a.tolist() and tb.tolist() == [1, 0]


def test_pinned_mirror_starts_with_the_buffer_and_copies_what_is_written():
    dst = torch.arange(8)
    m = PinnedMirror(dst)
    m.wait()  # (no copy yet: returns at once)
    host = m.array
    assert host.tolist() == list(range(8))
    host[2:4] = [-1, -2]
    assert dst.tolist() == list(range(8))  # nothing reaches the buffer before upload
    m.upload()
    assert dst.tolist() == [0, 1, -1, -2, 4, 5, 6, 7]  # values not rewritten are copied as they were
    m.wait()
    assert m.array.tolist() == dst.tolist()


def test_pinned_mirror_refuses_a_shaped_buffer():
    with pytest.raises(ValueError, match="flat buffer"):
        PinnedMirror(torch.zeros(2, 3))
