"""Malformed client events at volume: every one gets an `error` event of the client-mistake kind (never
`server_error`), the server logs no exception, no session is closed, each still answers afterwards, and the engine
(the fake one, and the real one on the CPU) ends idle with every KV block free. Events are valid templates with
fields deleted, replaced by values of the wrong type or range (NaN, 2**63, lone surrogates, huge strings), or
added; the seed is fixed."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
from typing import Any

import numpy as np
import pytest
import websockets

from server.settings import Settings
from tests.fakes.harness import RunningServer, fake_settings, recv_event, recv_until, send, user_text

SESSIONS = 6
EVENTS = 250

# What a malformed event may be refused with (client mistakes; README "Errors").
CLIENT_CODES = {
    "invalid_json", "unknown_event", "unknown_parameter", "unsupported_parameter", "invalid_value", "invalid_audio",
    "invalid_item", "unsupported_item_type", "unsupported_content_type", "unsupported_session_type",
    "unsupported_audio_format", "unsupported_turn_detection", "input_audio_buffer_commit_empty",
    "input_audio_buffer_too_large", "conversation_already_has_active_response", "response_cancel_not_active",
    "item_truncate_invalid_item_id", "item_truncate_invalid_content_index", "item_truncate_invalid_audio_end_ms",
}


def _tone_b64(samples: int = 2400) -> str:
    return base64.b64encode((np.sin(np.arange(samples) / 5.0) * 8000).astype("<i2").tobytes()).decode()


TEMPLATES: list[dict[str, Any]] = [
    {"type": "session.update", "session": {
        "type": "realtime", "instructions": "be brief", "max_output_tokens": 20, "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": {
            "type": "server_vad", "threshold": 0.5, "silence_duration_ms": 300, "prefix_padding_ms": 300}},
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}},
        "moss": {"sampling": {"temperature": 0.6, "top_k": 20, "seed": 1}}}},
    {"type": "input_audio_buffer.append", "audio": _tone_b64()},
    {"type": "input_audio_buffer.commit"},
    {"type": "input_audio_buffer.clear"},
    {"type": "response.create", "response": {"output_modalities": ["audio"], "max_output_tokens": 5,
                                             "moss": {"sampling": {"top_p": 0.9}}}},
    {"type": "response.cancel"},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}]}},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": _tone_b64()}]}},
    {"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "ok"}]}},
    {"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, "audio_end_ms": 100},
]
ODD_VALUES: list[Any] = [None, True, -1, 0, 2 ** 63, 1e308, float("nan"), float("inf"), "", "x" * 5000, [], [1, 2], {},
                         {"a": {"b": []}}, "\ud800", "\x00", -0.0, 3.5, "audio/pcmu", "server_vad"]


def _mutate(obj: Any, rng: random.Random) -> Any:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            r = rng.random()
            if r < 0.1:
                continue
            out[k] = rng.choice(ODD_VALUES) if r < 0.3 else _mutate(v, rng)
        if rng.random() < 0.1:
            out[rng.choice(["zzz", "type", "event_id", "session", "response", "item"])] = rng.choice(ODD_VALUES)
        return out
    if isinstance(obj, list):
        return [_mutate(x, rng) for x in obj] if obj and rng.random() < 0.8 else rng.choice(ODD_VALUES + [obj * 3])
    return obj if rng.random() < 0.7 else rng.choice(ODD_VALUES)


def _frame(event: dict[str, Any]) -> str:
    # NaN / Infinity are not JSON; the server must refuse them like any other malformed text.
    return json.dumps(event, allow_nan=True)


async def _fuzz_one(url: str, seed: int) -> tuple[list[dict[str, Any]], int | None]:
    rng = random.Random(seed)
    async with websockets.connect(url, max_size=None) as ws:
        assert (await recv_event(ws))["type"] == "session.created"
        events: list[dict[str, Any]] = []

        async def read() -> None:
            async for message in ws:
                events.append(json.loads(message))

        reader = asyncio.create_task(read())
        for _ in range(EVENTS):
            template = rng.choice(TEMPLATES)
            await ws.send(_frame(_mutate(template, rng) if rng.random() < 0.85 else template))
            if rng.random() < 0.05:
                await asyncio.sleep(0.02)
        # Back to a known state, then one answer must still come.
        await send(ws, "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await asyncio.sleep(0.3)
        await send(ws, "response.cancel")
        await asyncio.sleep(0.5)  # a cancelled answer's response.done, if one was running
        reader.cancel()
        try:
            await reader
        except (asyncio.CancelledError, websockets.ConnectionClosed):
            pass
        await user_text(ws, "are you still there")
        await send(ws, "response.create", response={"output_modalities": ["text"], "max_output_tokens": 8})
        done = await recv_until(ws, "response.done", timeout=60)
        events.extend(done)
        # An answer: whole, or cut at max_output_tokens (the real engine's random weights rarely end by themselves).
        assert done[-1]["response"]["status"] in ("completed", "incomplete"), done[-3:]
        return events, ws.close_code


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["fake", "tiny-random"])
async def test_malformed_events_get_client_errors_and_leave_nothing_behind(caplog, engine):
    """`tiny-random`: the real engine process on the CPU, whose KV blocks are really counted."""
    caplog.set_level(logging.ERROR)  # the real engine on a CPU logs slow steps as warnings
    limits = {"max_sessions": SESSIONS + 1, "max_message_bytes": 256 * 1024}
    settings = fake_settings(**limits) if engine == "fake" else Settings(
        model="tiny-random", codec="tiny-random", device="cpu", engine_ping_interval_s=0.25,
        engine_ping_timeout_s=60.0, engine_ready_timeout_s=300.0, **limits)
    with RunningServer(settings) as srv:
        results = await asyncio.gather(*(_fuzz_one(srv.ws, seed) for seed in range(SESSIONS)))
        for events, close_code in results:
            assert close_code in (None, 1000)  # closed by this client at the end, never by the server
            codes = [e["error"]["code"] for e in events if e["type"] == "error"]
            assert codes, "the malformed events drew no error at all"
            assert set(codes) <= CLIENT_CODES, sorted(set(codes) - CLIENT_CODES)
        st = await srv.wait_engine_idle(60)
        assert st["sessions"] == 0 and st["running"] == 0 and st["kv_free"] == st["kv_total"], st
        assert srv.health().json()["sessions"] == 0
    raised = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not raised, [r.getMessage() for r in raised]
