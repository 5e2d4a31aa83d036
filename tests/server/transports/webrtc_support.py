"""Test helpers for the WebRTC transport: a scripted engine link, an app with the WebRTC routes, a server thread.

The scripted engine stands in for the engine process so the transport tests run in seconds on CPU: it
answers every response with a transcript delta and a few 400 ms chunks of a 24 kHz tone (clearly non-silent,
unlike anything the transport could fabricate), honours cancel, and records what it was sent.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI

from engines.audio.wav import float32_to_pcm16
from engines.protocol import messages as m
from server.session.manager import SessionManager
from server.session.session import Session, SessionLimits
from server.transports.webrtc.routes import install
from tests.fakes.harness import free_port
from tests.paths import DATA

SPEECH_WAV = DATA / "speech_en_16k.wav"
CHUNK_SAMPLES = 9600  # 400 ms at 24 kHz: 5 codes at 12.5 Hz, the codec's chunk


@dataclass
class ScriptedEngine:
    """EngineLink for Session: answers each CreateResponse with `chunks` tone chunks, `chunk_gap_s` apart."""

    chunks: int = 3
    chunk_gap_s: float = 0.15
    first_chunk_delay_s: float = 0.05
    ready: bool = True
    sessions: dict[str, Session] = field(default_factory=dict)
    received: list[Any] = field(default_factory=list)
    _tasks: dict[str, asyncio.Task] = field(default_factory=dict)

    def register(self, session_id: str, session: Session) -> None:
        self.sessions[session_id] = session

    def unregister(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def pick(self) -> ScriptedEngine | None:  # the one engine sessions are placed on
        return self if self.ready else None

    def count(self, kind: type) -> int:
        return sum(isinstance(x, kind) for x in self.received)

    def user_audio_seconds(self) -> float:
        return sum(len(x.pcm16k) // 2 for x in self.received if isinstance(x, m.AppendUserAudio)) / 16000

    async def send(self, msg: Any) -> None:
        self.received.append(msg)
        if isinstance(msg, m.Sync):
            self._deliver(msg.session_id, m.Synced(msg.session_id, msg.seq))
        elif isinstance(msg, m.CreateResponse):
            self._tasks[msg.response_id] = asyncio.ensure_future(self._answer(msg))
        elif isinstance(msg, m.CancelResponse):
            task = self._tasks.pop(msg.response_id, None)
            if task is not None and not task.done():
                task.cancel()
                self._deliver(msg.session_id, m.ResponseDone(msg.session_id, msg.response_id, "cancelled",
                                                             reason="client_cancelled"))

    def _deliver(self, sid: str, out: Any) -> None:
        s = self.sessions.get(sid)
        if s is not None:
            s.on_engine_message(out)

    async def _answer(self, req: m.CreateResponse) -> None:
        sid, rid = req.session_id, req.response_id
        await asyncio.sleep(self.first_chunk_delay_s)
        self._deliver(sid, m.ResponseStarted(sid, rid, prompt_rows=4))
        self._deliver(sid, m.TextDelta(sid, rid, "scripted answer"))
        t = np.arange(CHUNK_SAMPLES) / 24000.0
        for i in range(self.chunks if req.modality == "audio" else 0):
            tone = 0.3 * np.sin(2 * np.pi * (330.0 + 110.0 * i) * t)
            self._deliver(sid, m.AudioChunk(sid, rid, float32_to_pcm16(tone), i))
            await asyncio.sleep(self.chunk_gap_s)
        self._tasks.pop(rid, None)
        self._deliver(sid, m.ResponseDone(sid, rid, "completed", output_rows=10, prompt_rows=4,
                                          audio_samples=CHUNK_SAMPLES * self.chunks, text="scripted answer"))


@dataclass
class FakeSettings:
    """The subset of server.settings.Settings the WebRTC routes read."""

    model: str = "tiny-random"
    model_name: str = "moss-speech"
    api_keys: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    ice_servers: list[dict[str, Any]] = field(default_factory=list)
    max_calls: int = 4
    ice_timeout_s: float = 20.0
    webrtc_prebuffer_ms: int = 60
    turn_secret: str | None = None
    turn_ttl_s: int = 86400
    vad: bool = True
    end_of_turn_model: bool = True


@functools.cache
def _vad_batcher():  # noqa: ANN202 - torch is imported only by the tests that use server_vad
    from server.vad import VadBatcher

    return VadBatcher()


def vad_factory():
    return _vad_batcher().stream()


def build_app(engine: ScriptedEngine, settings: FakeSettings | None = None, max_sessions: int = 8) -> FastAPI:
    settings = settings or FakeSettings()
    app = FastAPI()
    manager = SessionManager(engine, max_sessions=max_sessions, limits=SessionLimits(), model=settings.model_name,
                             vad_factory=vad_factory)
    app.state.sessions = manager
    install(app, settings, manager)
    return app


class ServerThread:
    """uvicorn on 127.0.0.1 in a thread with its own event loop (so sync clients like Playwright can drive it)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def run_coro(self, coro: Any, timeout: float = 10.0) -> Any:
        """Run a coroutine on the server's loop (to inspect or close server-side objects)."""
        loop = next(iter(self._server.servers)).get_loop() if self._server.servers else None
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def __exit__(self, *exc: Any) -> None:
        svc = getattr(self.app.state, "webrtc", None)
        if svc is not None and self._server.servers:
            try:
                self.run_coro(svc.calls.close_all("test server stopping"))
            except Exception:  # noqa: BLE001 - best effort before shutdown
                pass
        self._server.should_exit = True
        self._thread.join(15)
