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


def upload_into(dst: torch.Tensor, arrays: list[np.ndarray]) -> None:
    """Write the arrays, raveled one after another, into the flat tensor `dst` (as many elements) in one copy:
    into a buffer that already exists on the device, such as a CUDA graph's input."""
    host = _packed(arrays, dst.dtype)
    if host.numel() != dst.numel():
        raise ValueError(f"{host.numel()} values for a buffer of {dst.numel()}")
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.is_cuda)
