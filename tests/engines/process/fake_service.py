"""A Service on the tiny-random Engine with small fakes of the codec, and helpers to drive it.

The fakes follow the codec's stream interface (encoder: one code per 80 ms of 16 kHz PCM;
decoder: 1920 samples per code, released 5 codes at a time), so tests can count rows and
samples exactly.
"""

from __future__ import annotations

import numpy as np

from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.prompt import PromptBuilder
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from engines.speech_out.stream import Job
from tests.engines.process import service_loop

C = b"client-1"
SAMPLES_16K_PER_CODE = 1280


class FakeEncoderStream:
    def __init__(self) -> None:
        self.buf = np.zeros(0, np.float32)
        self.n = 0

    def _code(self, chunk: np.ndarray) -> int:
        self.n += 1
        return (int(np.abs(chunk).sum() * 100) + 7 * self.n) % 16384

    def push(self, pcm: np.ndarray) -> list[int]:
        self.buf = np.concatenate([self.buf, pcm])
        out = []
        while len(self.buf) >= SAMPLES_16K_PER_CODE:
            out.append(self._code(self.buf[:SAMPLES_16K_PER_CODE]))
            self.buf = self.buf[SAMPLES_16K_PER_CODE:]
        return out

    def finalize(self, last: np.ndarray | None = None) -> list[int]:
        out = self.push(last) if last is not None else []
        out += [self._code(self.buf)] if len(self.buf) else []
        self.buf = np.zeros(0, np.float32)
        return out


class FakeEncoder:
    def open_stream(self) -> FakeEncoderStream:
        return FakeEncoderStream()


class FakeDecoderStream:
    """Chunks of 5 codes as they come; finishing takes the rest (the last chunk final)."""

    first_audio_codes = 5

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.codes: list[int] = []
        self.closed = False

    def add(self, codes: list[int]) -> None:
        self.codes += codes
        self.pending += codes

    def take_jobs(self, finishing: bool = False) -> list[Job]:
        jobs = []
        while len(self.pending) >= 5 or (finishing and self.pending):
            jobs.append(Job(self, self.pending[:5], [], False))
            del self.pending[:5]
        if finishing:
            if not jobs:
                jobs.append(Job(self, [], [], False))
            jobs[-1].final = True
        return jobs

    def close(self) -> None:
        self.closed = True


class FakeDecoder:
    """1920 samples per code."""

    def __init__(self) -> None:
        self.streams: list[FakeDecoderStream] = []

    def open_stream(self, session_id: str, voice=None, seed: int = 0) -> FakeDecoderStream:
        s = FakeDecoderStream()
        self.streams.append(s)
        return s

    def run_jobs(self, jobs: list[Job], between=None) -> list[np.ndarray]:
        return [np.full(len(j.codes) * 1920, 0.25, np.float32) for j in jobs]


def make_service(**cfg) -> Service:
    ec = EngineConfig(**{"kv_cache_bytes": 8 * 1024 * 1024, "max_model_len": 2048, **cfg})
    return Service(Engine.from_name("tiny-random", ec, seed=0), StandInTokenizer(), FakeEncoder(), FakeDecoder())


def run(svc: Service) -> list:
    return [msg for _, msg in service_loop.until_idle(svc)]


def send(svc: Service, msg, client: bytes = C) -> list:
    return [x for _, x in svc.handle(client, msg)]


def of(msgs: list, cls: type) -> list:
    return [x for x in msgs if isinstance(x, cls)]


def speech(seconds: float, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(int(16000 * seconds)) * 3000).astype("<i2").tobytes()


def greedy(n: int, min_new: int = 0) -> m.Sampling:
    return m.Sampling(greedy=True, max_new_tokens=n, min_new_tokens=min_new)


PB = PromptBuilder(StandInTokenizer())
