"""WebRTC calls on the real engine (tiny random weights, CPU): speech with mid-turn pauses on the mic track and, on the
data channel, turn and answer events at random, often several at once, among voice uploads over HTTP and switches
between turn detectors. Every error is a client mistake's, nothing is logged as an exception, each call still answers
afterwards, and the engine ends idle with every KV block free. Seeds are fixed."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

import httpx
import pytest

from tests.fakes.harness import RunningServer, tiny_settings
from tests.paths import DATA
from tests.server.fuzz_support import (
    SEMANTIC_VAD,
    SERVER_VAD,
    assert_engine_idle,
    assert_only_client_errors,
    until,
)
from tests.server.transports.webrtc_client import Client, WavMicTrack

WAV = DATA / "speech_paused_en_16k.wav"
DETECTORS = SERVER_VAD + SEMANTIC_VAD


def _user_text(text: str, item_id: str | None = None) -> dict[str, Any]:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return {"type": "conversation.item.create", "item": item | ({"id": item_id} if item_id else {})}


def _random_event(rng: random.Random, c: Client) -> dict[str, Any]:
    r = rng.random()
    if r < 0.1:
        return {"type": "input_audio_buffer.clear"}
    if r < 0.2:
        return {"type": "input_audio_buffer.commit"}
    if r < 0.3:
        return {"type": "response.cancel"}
    if r < 0.42:
        return {"type": "response.create", **rng.choice([{}, {"response": {"instructions": "be brief"}}, {"response": {
            "conversation": "none", "instructions": "classify", "output_modalities": ["text"]}},
            {"response": {"output_modalities": ["text"]}}])}
    if r < 0.5:
        answers = [e["item"]["id"] for _, e in c.events if e["type"] == "response.output_item.added"]
        return {"type": "conversation.item.truncate", "item_id": answers[-1] if answers else "item_x",
                "content_index": 0, "audio_end_ms": rng.randint(0, 3000)}
    if r < 0.56:
        items = [e["item"]["id"] for _, e in c.events if e["type"] == "conversation.item.added"]
        return {"type": "conversation.item.delete", "item_id": rng.choice(items) if items else "item_x"}
    if r < 0.66:
        return {"type": "output_audio_buffer.clear"}
    if r < 0.78:
        return {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": rng.choice(DETECTORS)}}}}
    if r < 0.84:
        return {"type": "session.update", "session": {"type": "realtime", "instructions": rng.choice(
            ["be brief", None]), "output_modalities": rng.choice([["text"], ["audio"]])}}
    if r < 0.92:
        return _user_text("hello")
    return {"type": "conversation.item.retrieve", "item_id": "item_x"}


async def _call(srv: RunningServer, seed: int, seconds: float) -> tuple[list[dict[str, Any]], int | None]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=30) as http:
        c = Client(srv.http, WavMicTrack(WAV, lead_silence_s=rng.choice([0.2, 1.0]), again_after_s=0.8))
        try:
            await c.connect(http)
            _, created = await c.wait_event("session.created", 30)
            sid = created["session"]["moss"]["session_id"]
            c.send({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 10, "audio": {
                "input": {"turn_detection": rng.choice([d for d in DETECTORS if d is not None])}}}})
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await asyncio.sleep(rng.choice([0.0, 0.05, 0.2, 0.4]))
                if rng.random() < 0.05:
                    r = await http.post(f"{srv.http}/v1/realtime/calls/{c.call_id}/voice", content=WAV.read_bytes())
                    assert r.status_code == 204, r.text
                for _ in range(rng.choice([1, 1, 1, 4])):  # now and then a burst, all on the channel at once
                    c.send(_random_event(rng, c))

            # Back to a known state (push to talk, no answer, empty input buffer); then an answer must still come.
            c.send({"type": "session.update", "session": {"type": "realtime", "instructions": None,
                                                          "output_modalities": ["audio"],
                                                          "audio": {"input": {"turn_detection": None}}}})
            c.send({"type": "response.cancel"})
            c.send(_user_text("still there", "item_mark"))
            await until(lambda: any(e["type"] == "conversation.item.added" and e["item"]["id"] == "item_mark"
                                    for _, e in c.events), "every event before the mark taken", c.types)

            def quiet() -> bool:
                s = srv.app.state.sessions.sessions.get(sid)
                return s is not None and not s.response_active and not s.tasks.tasks

            await until(quiet, "the session to settle", c.types)
            # (every event the server sent before has reached the client: the channel keeps their order)
            c.send(_user_text("settled", "item_settled"))
            await until(lambda: any(e["type"] == "conversation.item.added" and e["item"]["id"] == "item_settled"
                                    for _, e in c.events), "the events sent before the session settled", c.types)
            c.send({"type": "input_audio_buffer.clear"})  # (the live mic keeps filling it under push to talk)
            n = len(c.events)
            c.send({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 8}})
            await until(lambda: any(e["type"] == "response.done" for _, e in c.events[n:]), "the last answer", c.types)
            done = next(e for _, e in c.events[n:] if e["type"] == "response.done")
            assert done["response"]["status"] in ("completed", "incomplete"), done
            assert srv.app.state.sessions.sessions.get(sid) is not None  # the call is still up
            return [e for _, e in c.events], None
        finally:
            await c.close()


@pytest.mark.timeout(300)
async def test_calls_with_random_events_on_the_real_engine(caplog):
    caplog.set_level(logging.ERROR)
    with RunningServer(tiny_settings(max_sessions=4)) as srv:
        results = await asyncio.gather(*(_call(srv, seed, 8.0) for seed in range(2)))
        assert_only_client_errors(results)
        kinds = {e["type"] for events, _ in results for e in events}
        assert {"input_audio_buffer.speech_started", "response.created"} <= kinds
        await assert_engine_idle(srv, caplog)
