"""Device memory free for what a process allocates next (the KV pool, the speech decoder's cache)."""

from __future__ import annotations

import torch


def free_bytes(device: str | torch.device) -> int:
    """The driver's free memory once torch's allocator has returned its unused blocks. (What it keeps inside CUDA
    graphs' private pools is not free for other tensors: counting it, an H100 ran out.)"""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]
