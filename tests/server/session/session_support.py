"""An in-process Session on an in-memory engine link that records what the session sends (engine replies are
injected with `on_engine_message`), with Silero VAD, and helpers to feed it audio and read its events."""

from __future__ import annotations

import asyncio

import numpy as np

from engines.protocol import messages as m
from server.session.session import Session, SessionLimits
from server.vad import VadBatcher

CHUNK = np.full(9600, 1000, dtype="<i2").tobytes()  # 0.4 s of answer audio


class Link:
    ready = True

    def __init__(self) -> None:
        self.sent: list = []
        self.syncs: list = []
        self.registered: dict = {}

    async def send(self, msg) -> None:
        if isinstance(msg, m.Sync):  # answered as the engine does (every earlier input is handled), kept apart
            self.syncs.append(msg)
            s = self.registered.get(msg.session_id)
            if s is not None:
                asyncio.get_running_loop().call_soon(s.on_engine_message, m.Synced(msg.session_id, msg.seq))
            return
        self.sent.append(msg)

    def register(self, sid, s) -> None:
        self.registered[sid] = s

    def unregister(self, sid) -> None:
        self.registered.pop(sid, None)

    def of(self, cls) -> list:
        return [x for x in self.sent if isinstance(x, cls)]


async def settled(s: Session) -> None:
    """Until the tasks the session started and does not await (the held input's flush, an automatic answer, a close)
    have ended, those they started included."""
    while s.tasks.tasks:
        await asyncio.gather(*list(s.tasks.tasks), return_exceptions=True)


def drain(s: Session) -> list:
    out = []
    while len(s.outbound):
        out.append(s.outbound._q.popleft().item)
    return out


def types(items: list) -> list[str]:
    return [x["type"] if isinstance(x, dict) else "AUDIO" for x in items]


async def feed(s: Session, pcm: np.ndarray, rate: int = 24000, ms: int = 20) -> None:
    step = rate * ms // 1000
    for i in range(0, len(pcm), step):
        await s.feed_audio(pcm[i:i + step], rate)


def silence(seconds: float, rate: int = 24000) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.float32)


async def new_session(audio_out="events", link: Link | None = None, **limits) -> tuple[Session, Link]:
    link = link or Link()
    s = Session("sess_test", link, audio_out=audio_out, vad_factory=VadBatcher().stream, limits=SessionLimits(**limits))
    await s.start()
    assert types(drain(s)) == ["session.created"]
    return s, link


async def respond(s: Session, link: Link, modality: str = "audio", chunks: int = 2, status: str | None = "completed",
                  **done) -> str:
    """A response to the conversation so far, its engine output injected (`chunks` of CHUNK; `status` None: it has
    not ended); returns its id."""
    await s.handle_client_event({"type": "response.create", "response": {"output_modalities": [modality]}})
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseStarted(s.id, rid, prompt_rows=10))
    s.on_engine_message(m.TextDelta(s.id, rid, "hello"))
    for i in range(chunks if modality == "audio" else 0):
        s.on_engine_message(m.AudioChunk(s.id, rid, CHUNK, i))
    if status is not None:
        s.on_engine_message(m.ResponseDone(s.id, rid, status, output_rows=5, prompt_rows=10,
                                           audio_samples=chunks * 9600 if modality == "audio" else 0, **done))
    await settled(s)
    return rid
