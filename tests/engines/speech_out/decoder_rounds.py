"""Codec decoder test inputs and drivers: random codes, a stream pushed in given sizes, the tolerances of the
streaming and batching checks, decoding finished streams' chunks in rounds as the engine's codec worker batches
them, and rounds queued ahead of their collection."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from engines.speech_out import CodecDecoder
from engines.speech_out.decoder import cache_page_bytes
from engines.speech_out.stream import Job

SPC = 1920  # samples per code
# Streamed vs offline run the same ops on the same shapes: equal up to float noise.
STREAM_TOL = 1e-6
# Batched vs alone: different batch shapes may pick different kernels; float32 rounding only.
BATCH_TOL = 1e-5


def small_cache_decoder(pages: int, **load) -> CodecDecoder:
    """The tiny random codec with a full-context cache of exactly `pages` pages (float32 estimator); `load`: more
    CodecDecoder.load arguments."""
    cfg = CodecDecoder.load("tiny-random", context="window").cfg
    dec = CodecDecoder.load("tiny-random", cache_gib=pages * cache_page_bytes(cfg, torch.float32) / 2**30, **load)
    assert dec.full.pages.n_pages == pages
    return dec


def _codes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16384, n)


def _stream(dec: CodecDecoder, codes: np.ndarray, sizes: list[int], seed: int = 0, voice=None) -> list[np.ndarray]:
    s = dec.open_stream("t", voice=voice, seed=seed)
    parts, i, k = [], 0, 0
    while i < len(codes):
        n = sizes[k % len(sizes)]
        parts.append(s.push(codes[i:i + n]))
        i, k = i + n, k + 1
    parts.append(s.finalize())
    s.close()
    return parts


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


def random_position_biases(flow, seed: int = 0) -> None:
    """Random relative-position biases in the flow's encoder: the presets' are zero, which would hide position bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flow.encoder.parameters():
            if p.dim() == 2 and p.shape[0] == flow.cfg.heads:
                p.copy_(torch.randn(p.shape, generator=g))


def tail_rounds(dec: CodecDecoder, lengths: tuple[int, ...]) -> tuple[list, list[list[Job]]]:
    """Streams holding `lengths` random codes, and the rounds decoding them: round r holds each answer's r-th chunk,
    and an answer releases its held tail (a job of no codes) in the round right after its last chunk."""
    streams = [dec.open_stream(f"s{i}", seed=i) for i in range(len(lengths))]
    per_stream = []
    for i, (s, n) in enumerate(zip(streams, lengths, strict=True)):
        s.add(_codes(n, seed=i))
        per_stream.append(s.take_jobs() + [Job(s, [], [], True)])
    return streams, [[js[r] for js in per_stream if r < len(js)] for r in range(max(map(len, per_stream)))]


def rounds_pcm(dec: CodecDecoder, lengths: tuple[int, ...], ahead: bool) -> list[np.ndarray]:
    """tail_rounds' PCM per stream: each round run alone (`run_jobs`), or with `ahead` each queued before the round
    before it is collected (`queue_jobs`, then `collect` in order)."""
    streams, rounds = tail_rounds(dec, lengths)
    out: dict[int, list[np.ndarray]] = {id(s): [] for s in streams}

    def take(jobs: list[Job], pcm: list) -> None:
        for j, p in zip(jobs, pcm, strict=True):
            out[id(j.stream)].append(p)

    if ahead:
        pending = None  # (jobs, their queued round)
        for jobs in rounds:
            queued = dec.queue_jobs(jobs)
            if pending is not None:  # the next round queued: now the one before it is collected
                take(pending[0], pending[1].collect())
            pending = jobs, queued
        take(pending[0], pending[1].collect())
    else:
        for jobs in rounds:
            take(jobs, dec.run_jobs(jobs))
    pcm = [np.concatenate(out[id(s)]) for s in streams]
    for s in streams:
        s.close()
    return pcm
