"""A round of decoder jobs queued on the device, collected later: `CodecDecoder.queue_jobs` returns it with every
kernel of the round queued (the flow, the vocoder, the copy of its windows to pinned host memory) and the event after
them; `collect` waits for that event only, then cuts and crossfades the windows on the host. The next round may be
queued on the same stream before this one is collected: the host prepares it while the device still runs this one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.speech_out.flow.pages import DecoderCacheFull
from engines.speech_out.stream import Job
from engines.speech_out.vocoder.vocoder import Rendered, WindowedVocoder


@dataclass
class QueuedRound:
    """jobs' results so far (PCM of jobs with nothing to render, a DecoderCacheFull of jobs without pages, None for
    the rest), the vocoder's windows on their way to the host per group (result indices, jobs, windows), and the
    event after the round's work (None off CUDA: there the work ran as it was queued)."""

    jobs: list[Job]
    results: list[np.ndarray | DecoderCacheFull | None]
    windowed: WindowedVocoder
    rendered: list[tuple[list[int], list[Job], Rendered]] = field(default_factory=list)
    flushes: list[int] = field(default_factory=list)  # jobs that only release their answer's held tail
    done: Any = None  # torch.cuda.Event
    gpu_wait_s: float = 0.0  # how long `collect` waited for the device

    def mark_queued(self, device: torch.device) -> None:
        """The event after everything queued so far on the current stream: the round's work."""
        if device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> None:
        """Until the round's work is done on the device (its windows on the host)."""
        t0 = time.perf_counter()
        if self.done is not None:
            self.done.synchronize()  # (releases the GIL: the engine loop runs meanwhile)
        self.gpu_wait_s = time.perf_counter() - t0

    def collect(self) -> list[np.ndarray | DecoderCacheFull]:
        """The round's PCM per job, in order (or the DecoderCacheFull of a job its round found no page for). Rounds
        of one stream are collected in the order they were queued: an answer's crossfade carries into its next."""
        self.wait()
        for i in self.flushes:  # (after every earlier round's collect: the tail is that of the answer's last window)
            v = self.jobs[i].stream.voc_state
            self.results[i] = v.tail if v.tail is not None else np.zeros(0, np.float32)
            v.tail = None
        for idx, js, wav in self.rendered:
            outs = self.windowed.finish(wav, [j.stream.voc_state for j in js], [j.final for j in js])
            for i, o in zip(idx, outs, strict=True):
                self.results[i] = o
        out: list[np.ndarray | DecoderCacheFull] = []
        for j, r in zip(self.jobs, self.results, strict=True):
            if isinstance(r, DecoderCacheFull):
                out.append(r)
                continue
            p = np.asarray(r, dtype=np.float32)
            j.stream.samples_out += p.shape[0]
            out.append(p)
        return out


def raise_full(pcm: list[np.ndarray | DecoderCacheFull]) -> list[np.ndarray]:
    """A round's results for callers that stop at any failure (a stream decoded on its own, a bench's rounds): a
    job's DecoderCacheFull is raised."""
    for p in pcm:
        if isinstance(p, DecoderCacheFull):
            raise p
    return pcm  # type: ignore[return-value]
