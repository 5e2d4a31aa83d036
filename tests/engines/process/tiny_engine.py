"""The tiny engine the engine-process tests drive: its construction, a question's audio, and an engine server on an
in-process socket with text turns through it."""

from __future__ import annotations

import zmq

from engines.audio.wav import float32_to_pcm16, read_wav
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.loop import EngineServer
from engines.process.observe.gpu_window import GpuWindow
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from tests.paths import DATA

WAV = DATA / "speech_en_16k.wav"
N_OUT = 8  # answer rows: 8 codes = the first chunk (5 + 3 lookahead), then the final one


def engine() -> Engine:
    return Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 * 1024 * 1024, max_model_len=2048), seed=0)


def question_pcm(seconds: float = 1.5) -> bytes:
    pcm, rate = read_wav(WAV)
    assert rate == 16000
    return float32_to_pcm16(pcm[: int(seconds * rate)])


def served(window: GpuWindow | None = None) -> tuple[EngineServer, zmq.Context]:
    """The tiny engine behind an in-process socket (inproc://eng)."""
    ctx = zmq.Context()
    return EngineServer(Service(engine(), StandInTokenizer()), "inproc://eng", ctx, window=window), ctx


def text_turns(server: EngineServer, ctx: zmq.Context, sessions: int, tokens: int = 6) -> None:
    """`sessions` sessions each answer a text turn of `tokens` greedy tokens, the server run until idle."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("inproc://eng")
    greedy = m.Sampling(greedy=True, max_new_tokens=tokens, min_new_tokens=tokens)
    try:
        for i in range(sessions):
            sock.send(m.encode(m.OpenSession(f"s{i}")))
            sock.send(m.encode(m.AddUserText(f"s{i}", "i", "hello there")))
            sock.send(m.encode(m.CreateResponse(f"s{i}", "r", "text", greedy)))
        server.run_once(timeout_ms=100)
        for _ in range(500):
            server.run_once(timeout_ms=5)
            if not server.service.has_work():
                break
    finally:
        sock.close(0)
