"""Decoding finished streams' chunks in rounds, as the engine's codec worker batches them."""

from __future__ import annotations

from collections import deque

import numpy as np

from engines.speech_out import CodecDecoder


def in_rounds(dec: CodecDecoder, streams: list) -> tuple[list[np.ndarray], list[int]]:
    """Every stream finished and its chunks decoded as the engine's codec worker decodes them: rounds of one
    `run_jobs` batch with the next chunk of every stream that has one left. Each stream's PCM, and each round's batch
    size."""
    queues = [deque(s.take_jobs(finishing=True)) for s in streams]
    got: list[list[np.ndarray]] = [[] for _ in streams]
    sizes = []
    while any(queues):
        idx = [i for i, q in enumerate(queues) if q]
        for i, pcm in zip(idx, dec.run_jobs([queues[i].popleft() for i in idx]), strict=True):
            got[i].append(pcm)
        sizes.append(len(idx))
    return [np.concatenate(g) for g in got], sizes
