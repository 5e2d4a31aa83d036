"""Speculative answers end to end on CPU: a real server on loopback with the real engine process (tiny-random model
and codec), `--speculative-server-vad`, and a turn that pauses twice mid-way (tests/data/speech_paused_en_16k.wav).
Each pause starts an answer that the speech after it withdraws; the client sees one turn and one answer."""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import pytest
import websockets

from server.audio.pcm import read_wav
from tests.fakes.harness import RunningServer, recv_event, recv_until, send, tiny_settings
from tests.paths import DATA
from tests.server.e2e_support import b64_chunks


@pytest.fixture(scope="module")
def srv():
    with RunningServer(tiny_settings(drain_timeout_s=1.0, speculative_server_vad=True)) as s:
        yield s


def counters(srv) -> dict[str, float]:
    text = httpx.get(srv.http + "/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r'^moss_speculative_answers_total\{outcome="(\w+)"\} (\S+)$', text,
                                               re.M)}


async def test_pauses_withdraw_their_answers_unseen_and_the_turn_is_answered_once(srv):
    x, _ = read_wav(DATA / "speech_paused_en_16k.wav", target_rate=24000)
    async with websockets.connect(srv.ws, max_size=None) as ws:
        assert (await recv_event(ws))["type"] == "session.created"
        await send(ws, "session.update", session={"type": "realtime", "max_output_tokens": 6, "audio": {
            "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 1000}}}})
        assert (await recv_event(ws))["type"] == "session.updated"
        for chunk in b64_chunks(np.concatenate([x, np.zeros(36000, np.float32)])):  # at real time, as a user
            await send(ws, "input_audio_buffer.append", audio=chunk)
            await asyncio.sleep(0.1)
        evs = await recv_until(ws, "response.done", timeout=240)
    t = [e["type"] for e in evs]
    assert "error" not in t, [e for e in evs if e["type"] == "error"]
    assert t.count("input_audio_buffer.speech_started") == t.count("input_audio_buffer.speech_stopped") == 1, t
    assert t.count("response.created") == 1 and t.index("input_audio_buffer.committed") < t.index("response.created")
    rid = evs[-1]["response"]["id"]
    assert all(e.get("response_id", rid) == rid for e in evs), "an event of a withdrawn answer reached the client"
    assert evs[-1]["response"]["status"] in ("completed", "incomplete"), (t, evs[-1], counters(srv))
    # Each pause started an answer unless the one withdrawn before was still ending in the (slow, CPU) engine.
    c = counters(srv)
    assert 1 <= c.get("withdrawn", 0) <= 2 and c.get("confirmed", 0) == 1, c
