"""Host -> device copies of small index arrays without a stream sync.

A copy from pageable host memory waits for the stream's queued work before it starts (CUDA stages it through a
driver buffer); from pinned memory it is queued like a kernel. Several arrays go in one pinned buffer and one copy.
"""

from __future__ import annotations

import numpy as np
import torch

# (no torch call to find the numpy dtype: each torch call may give up the GIL, and the callers' threads share it)
_NP_DTYPES = {torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32), torch.float32: np.dtype(np.float32)}


def _packed(arrays: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
    """The arrays raveled one after another into one host tensor of `dtype`."""
    np_dtype = _NP_DTYPES.get(dtype) or torch.empty(0, dtype=dtype).numpy().dtype
    flat = np.concatenate([np.asarray(a, dtype=np_dtype).ravel() for a in arrays]) if arrays else np.zeros(0, np_dtype)
    return torch.from_numpy(flat)


def upload(arrays: list[np.ndarray], device: torch.device, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Each array (any shape, numbers) as a `dtype` tensor on `device`, in their shapes: views of one copy."""
    host = _packed(arrays, dtype)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)  # the caching host allocator keeps it until copied
    if len(arrays) == 1:
        return [host.view(np.shape(arrays[0]))]
    parts = host.split([int(np.size(a)) for a in arrays])
    return [p.view(np.shape(a)) for p, a in zip(parts, arrays, strict=True)]


class PinnedMirror:
    """A pinned host copy of a flat device buffer (a CUDA graph's index inputs), written in place through numpy and
    copied over in one queued copy: no pinned allocation, packing or free per call (~0.1 ms of host time before a
    batch-1 codec round's first kernel). Starts with the buffer's values; values not rewritten are copied again as
    they are."""

    def __init__(self, dst: torch.Tensor) -> None:
        if dst.dim() != 1:
            raise ValueError(f"a flat buffer, not {tuple(dst.shape)}")
        self.dst = dst
        host = dst.to("cpu", copy=True)
        self.host = host.pin_memory() if dst.is_cuda else host
        self.array = self.host.numpy()  # the host values, written through this view after `wait`
        self._copied: torch.cuda.Event | None = None  # the last copy's completion

    def wait(self) -> None:
        """Until the last copy from the host values is done (normally long since): then they may be rewritten."""
        if self._copied is not None:
            self._copied.synchronize()

    def upload(self) -> None:
        """Queue the copy of the host values to the device buffer on the current stream."""
        self.dst.copy_(self.host, non_blocking=True)
        if self.dst.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
