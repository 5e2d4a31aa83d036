"""Whether float32 matmuls run on TF32 tensor cores, chosen per caller in a process where several threads launch work.

cuBLAS reads torch's TF32 switch (`torch.backends.cuda.matmul.allow_tf32`) when a matmul is launched or captured into
a CUDA graph, and the switch is process-wide. The flow's encoder may run its float32 matmuls on TF32 (a numerics
option of the codec decoder: PCM within ~1e-4 of float32), while the speech encoder's stay IEEE float32 (its streamed
codes equal whole-utterance codes) unless it runs on TF32 (`--encoder-tf32`), and its VQ's distances always do. Each
caller launches inside `float32_matmuls(tf32)`: one lock, so no thread launches under another's setting. Replays of
captured graphs need no lock (their kernels were chosen at capture). The callers: the flow encoder (its decoder's
setting); the speech encoder's steps and captures (its own), its VQ, HiFT's generator (its f0 classifier and source
merge) and the flow's speaker projection (IEEE), which may launch on the codec's other thread while the flow encoder
holds TF32. (The estimator's float32 cuBLAS fallback, past 640 rows, is not held: the server runs it in bf16.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_lock = threading.RLock()


@contextmanager
def float32_matmuls(tf32: bool) -> Iterator[None]:
    """Launch float32 matmuls (cuBLAS) with TF32 on or off until the block ends; other threads' blocks wait."""
    with _lock:
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
