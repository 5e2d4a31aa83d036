"""Codec task: one FIFO queue of chunks from all sessions, decoded in batches.

`step()` takes, in queue order, the oldest pending chunk of up to `max_batch` distinct sessions (a session's
chunks are sequential: its next chunk waits for the previous one, never another session's) and decodes
them as one batch. On CUDA the work runs on the task's own stream so it overlaps the language model's.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from engines.codec.decoder.codec_decoder import CodecDecoder
from engines.codec.decoder.stream import DecodeStream, Job
from engines.codec.decoder.voice import Voice
from engines.streams import driver_stream


class CodecTask:
    def __init__(self, decoder: CodecDecoder, max_batch: int = 64) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.decoder, self.max_batch = decoder, max_batch
        self.streams: dict[str, DecodeStream] = {}
        self.queue: deque[Job] = deque()
        dev = decoder.device
        self.cuda_stream = driver_stream(dev) if dev.type == "cuda" else None  # in the current stream's SM partition

    def open(self, session_id: str, voice: Voice | None = None, seed: int = 0) -> None:
        if session_id in self.streams:
            raise ValueError(f"session {session_id} already open")
        self.streams[session_id] = self.decoder.open_stream(session_id, voice, seed)

    def _stream(self, session_id: str) -> DecodeStream:
        try:
            return self.streams[session_id]
        except KeyError:
            raise KeyError(f"no open codec session {session_id}") from None

    def submit(self, session_id: str, codes) -> None:
        """Append codes (any count); full chunks (5 codes + 3 lookahead available) join the queue."""
        s = self._stream(session_id)
        s.add(codes)
        self.queue.extend(s.take_jobs())

    def finish(self, session_id: str) -> None:
        """No more codes for this session: its remaining codes and held tail join the queue."""
        self.queue.extend(self._stream(session_id).take_jobs(finishing=True))

    def close(self, session_id: str) -> None:
        """Drop the session and its queued chunks (abort / barge-in)."""
        s = self.streams.pop(session_id, None)
        if s is not None:
            self.queue = deque(j for j in self.queue if j.stream is not s)
            s.close()

    def pending(self) -> int:
        return len(self.queue)

    def step(self) -> dict[str, np.ndarray]:
        """Decode one batch; returns new PCM per session (float32, 24 kHz)."""
        picked: list[Job] = []
        seen: set[int] = set()
        rest: deque[Job] = deque()
        while self.queue:
            j = self.queue.popleft()
            if len(picked) < self.max_batch and id(j.stream) not in seen:
                picked.append(j)
            else:
                rest.append(j)
            seen.add(id(j.stream))
        self.queue = rest
        if not picked:
            return {}
        if self.cuda_stream is not None:
            self.cuda_stream.wait_stream(torch.cuda.current_stream(self.decoder.device))
            with torch.cuda.stream(self.cuda_stream):
                pcm = self.decoder.run_jobs(picked)  # .cpu() inside waits for this stream only
        else:
            pcm = self.decoder.run_jobs(picked)
        return {j.stream.session_id: p for j, p in zip(picked, pcm, strict=True)}
