"""Steady-state codec rounds as the server decodes them, for `moss-speech bench codec` and the codec profilers
(engines/profiling/profile_codec.py, engines/profiling/codec_timeline.py).

A round makes the decoder calls a round of the engine's codec worker makes for playing answers
(engines/process/codec_worker.py): each answer's new codes go to its decoder stream (`DecodeStream.add`), its ready
chunk is taken (`take_jobs`), and the chunks of every answer are decoded in one batch (`CodecDecoder.run_jobs`), on
a driver stream of the least priority, as the worker's are. Here every round gives each session one full chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from engines.cuda.streams import driver_stream
from engines.speech_out import CodecDecoder, DecodeStream, Voice
from engines.speech_out.queued import QueuedRound, raise_full


class SteadyRounds:
    """`sessions` decoder streams (stream i: seed i, voice `voices[i % len(voices)]`, None the decoder's default),
    fed random codes from `seed`."""

    def __init__(self, dec: CodecDecoder, sessions: int, seed: int = 0, voices: Sequence[Voice | None] = (None,)
                 ) -> None:
        if sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {sessions}")
        self.dec = dec
        self.rng = np.random.default_rng(seed)
        self.streams: list[DecodeStream] = [dec.open_stream(f"s{i}", voices[i % len(voices)], seed=i)
                                            for i in range(sessions)]
        for s in self.streams:  # the lookahead codes, so that every round after has a full chunk ready
            s.add(self.rng.integers(0, 16384, dec.cfg.flow.pre_lookahead))
        self.cuda_stream = driver_stream(dec.device) if dec.device.type == "cuda" else None

    def feed(self) -> None:
        """One chunk's codes more for every session (what the engine hands the worker between its rounds)."""
        for s in self.streams:
            s.add(self.rng.integers(0, 16384, self.dec.cfg.stream.chunk_codes))

    def decode(self) -> list[np.ndarray]:
        """The round's decode: every session's ready chunk in one batch. Returns PCM per session; a full decoder
        cache (more sessions than it keeps chunks for) is raised."""
        jobs = [job for s in self.streams for job in s.take_jobs()]
        with torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else contextlib.nullcontext():
            return self.dec.run_jobs_or_raise(jobs)

    def queue(self) -> QueuedRound:
        """`decode`'s round queued on the device, collected later (`QueuedRound.collect`, in the order queued)."""
        jobs = [job for s in self.streams for job in s.take_jobs()]
        with torch.cuda.stream(self.cuda_stream) if self.cuda_stream is not None else contextlib.nullcontext():
            return self.dec.queue_jobs(jobs)

    @staticmethod
    def collect(queued: QueuedRound) -> list[np.ndarray]:
        """A queued round's PCM per session, as `decode` returns it (a full decoder cache raised)."""
        return raise_full(queued.collect())

    def close(self) -> None:
        for s in self.streams:
            s.close()
