"""Helpers for the realtime WebSocket tests against a real server with the scripted fake engine."""

from __future__ import annotations

import asyncio
import base64
import sys
import time

import numpy as np
import websockets

from tests.fakes.harness import RunningServer, recv_event, recv_until, send, user_text

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW_ENGINE = ["env", "FAKE_ENGINE_CHUNKS=400", "FAKE_ENGINE_STEP_S=0.03", sys.executable, "-m",
               "tests.fakes.fake_engine", "--model", "x", "--codec", "x", "--device", "cpu"]


def connect(url: str, **kw):
    kw.setdefault("additional_headers", AUTH)
    return websockets.connect(url, max_size=None, **kw)


async def open_session(ws, turn_detection=None):
    created = await recv_event(ws)
    assert created["type"] == "session.created"
    await send(ws, "session.update",
               session={"type": "realtime", "audio": {"input": {"turn_detection": turn_detection}}})
    updated = await recv_event(ws)
    assert updated["type"] == "session.updated", updated
    return updated["session"]


def tone_b64(seconds: float, rate: int = 24000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    return base64.b64encode((0.2 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()).decode()


async def text_turn(ws, text: str, modality: str = "text") -> list[dict]:
    await user_text(ws, text)
    await send(ws, "response.create", response={"output_modalities": [modality]})
    return await recv_until(ws, "response.done")


def by_type(events: list[dict], etype: str) -> list[dict]:
    return [e for e in events if e["type"] == etype]


async def wait_running(s: RunningServer, n: int, timeout: float = 60.0) -> None:
    """Until the engine's stats say `n` requests run (they come from the last Pong, every 0.2 s here); the timeout
    only bounds a hang."""
    deadline = time.monotonic() + timeout
    while s.engine_stats()["running"] != n:
        assert time.monotonic() < deadline, s.engine_stats()
        await asyncio.sleep(0.05)
