"""Client events at volume: malformed ones (valid templates with fields deleted, replaced by values of the wrong type or
range - NaN, 2**63, lone surrogates, huge strings - or added), and real speech under server_vad or semantic_vad with
turn and answer events thrown in at random. Every error is of the client-mistake kind (never `server_error`), the
server logs no exception, no session is closed, each still answers afterwards, and the engine (the fake one, and the
real one on the CPU) ends idle with every KV block free. Seeds are fixed."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import random
import re
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from engines.audio.wav import write_wav
from server.audio.pcm import float32_to_pcm16, read_wav
from tests.fakes.harness import RunningServer, fake_settings, recv_event, recv_until, send, tiny_settings, user_text
from tests.paths import DATA
from tests.server.fuzz_support import (
    SEMANTIC_VAD,
    SERVER_VAD,
    assert_engine_idle,
    assert_only_client_errors,
    until,
)
from tests.server.transports.webrtc_support import SPEECH_WAV

SESSIONS = 6
EVENTS = 250

def _tone_b64(samples: int = 2400) -> str:
    return base64.b64encode((np.sin(np.arange(samples) / 5.0) * 8000).astype("<i2").tobytes()).decode()


def _wav(x: np.ndarray, rate: int) -> str:
    """Mono samples as a base64 WAV file (a voice prompt)."""
    b = io.BytesIO()
    write_wav(b, x, rate)
    return base64.b64encode(b.getvalue()).decode()


# A voice prompt: 0.2 s of a tone at 16 kHz.
_PROMPT = _wav((np.sin(np.arange(3200) / 7.0) * 0.3).astype(np.float32), 16000)

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
    {"type": "conversation.item.create", "item": {"type": "message", "role": "system", "content": [
        {"type": "input_text", "text": "be"}, {"type": "input_text", "text": "brief"}]}},
    {"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, "audio_end_ms": 100},
    {"type": "session.update", "session": {"type": "realtime", "moss": {"voice_prompt": {"wav": _PROMPT}}}},
    {"type": "conversation.item.retrieve", "item_id": "item_x"},
    {"type": "output_audio_buffer.clear"},
    {"type": "session.update", "session": {"type": "realtime", "audio": {
        "input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcma"}, "speed": 1.25}}}},
    {"type": "response.create", "response": {"conversation": "none", "instructions": "classify", "max_output_tokens": 4,
                                             "output_modalities": ["text"], "metadata": {"k": "v"}}},
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


async def _reading(ws: Any, events: list[dict[str, Any]]) -> asyncio.Task:
    async def read() -> None:
        async for message in ws:
            events.append(json.loads(message))

    return asyncio.create_task(read())


async def _still_answers(srv: RunningServer, sid: str, ws: Any, events: list[dict[str, Any]], reader: asyncio.Task
                         ) -> None:
    """Back to a known state (no VAD, default instructions, voice and sampling, no answer, empty input buffer), then
    one answer must still come. (A session.update applies every field it can, so the fuzzed ones changed some of
    these: a 5,000-character system prompt takes the real engine on a CPU minutes to prefill.)"""
    await send(ws, "session.update", session={
        "type": "realtime", "instructions": None, "audio": {"input": {"turn_detection": None}},
        "moss": {"voice_prompt": None, "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                     "repetition_penalty": 1.1, "min_output_tokens": 0}}})
    await send(ws, "response.cancel")
    await send(ws, "input_audio_buffer.clear")
    # The server takes a session's events in order, and on a loaded CPU it may still be working through the fuzzed
    # ones (answers created and cancelled among them) a while after they were sent: an item's
    # conversation.item.added says it has taken every event sent before it.

    def last() -> list[str]:
        return [e["type"] for e in events[-5:]]

    async def taken(mark: str) -> None:
        await send(ws, "conversation.item.create", item={"id": mark, "type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "are you still there"}]})
        await until(lambda: any(e["type"] == "conversation.item.added" and e["item"]["id"] == mark for e in events),
                     f"{mark} taken", last)

    def quiet() -> bool:
        """The server's session has no answer and no task of its own left (a held input's flush, an automatic
        answer after a cancelled one): nothing starts an answer by itself any more."""
        s = srv.app.state.sessions.sessions.get(sid)
        return s is not None and not s.response_active and not s.tasks.tasks

    await taken("item_still_answers")
    await until(quiet, "the session to settle", last)
    await taken("item_settled")  # (every event the server sent before has reached the reader)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.created") == kinds.count("response.done"), kinds[-5:]
    reader.cancel()
    try:
        await reader
    except (asyncio.CancelledError, websockets.ConnectionClosed):
        pass
    await send(ws, "response.create", response={"output_modalities": ["text"], "max_output_tokens": 8})
    done = await recv_until(ws, "response.done", timeout=60)
    events.extend(done)
    created = [e["response"]["id"] for e in done if e["type"] == "response.created"]
    assert created == [done[-1]["response"]["id"]], [e["type"] for e in done]  # this answer's end, nothing else's
    # An answer: whole, or cut at max_output_tokens (the real engine's random weights rarely end by themselves).
    assert done[-1]["response"]["status"] in ("completed", "incomplete"), done[-3:]


async def _opened(ws: Any) -> str:
    created = await recv_event(ws)
    assert created["type"] == "session.created"
    return created["session"]["moss"]["session_id"]


async def _fuzz_one(srv: RunningServer, seed: int) -> tuple[list[dict[str, Any]], int | None]:
    rng = random.Random(seed)
    async with websockets.connect(srv.ws, max_size=None) as ws:
        sid = await _opened(ws)
        events: list[dict[str, Any]] = []
        reader = await _reading(ws, events)
        for _ in range(EVENTS):
            template = rng.choice(TEMPLATES)
            await ws.send(_frame(_mutate(template, rng) if rng.random() < 0.85 else template))
            if rng.random() < 0.05:
                await asyncio.sleep(0.02)
        await _still_answers(srv, sid, ws, events, reader)
        return events, ws.close_code


async def _speak_chaotically(srv: RunningServer, seed: int, signal: np.ndarray, seconds: float, detectors: list[Any]
                             ) -> tuple[list[dict[str, Any]], int | None]:
    """Speech at about real time in odd chunk sizes, with commits, clears, cancels, answers (some out of band, some
    with instructions of their own), truncations (of the latest answer's item or of none), deletions of items, voice
    prompts (the default, one of 1 s, one too short to use), instructions and turn-detection changes among
    `detectors` thrown in at random (the first one, or the first that is not None, to begin with)."""
    rng = random.Random(seed)
    voices = [None, {"wav": _wav(signal[:24000], 24000)}, {"wav": _wav(signal[:240], 24000)}]
    async with websockets.connect(srv.ws, max_size=None) as ws:
        sid = await _opened(ws)
        events: list[dict[str, Any]] = []
        reader = await _reading(ws, events)
        first = dict(next(d for d in detectors if d is not None))
        if first["type"] == "server_vad":
            first["silence_duration_ms"] = rng.choice([200, 400, 800])
        await send(ws, "session.update", session={"type": "realtime", "max_output_tokens": 10, "audio": {"input": {
            "turn_detection": first}}})
        pos, end = 0, asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < end:
            r = rng.random()
            if r < 0.75:
                n = rng.choice([7, 240, 480, 960, 2400, 4800])
                chunk = np.take(signal, np.arange(pos, pos + n), mode="wrap")
                pos += n
                await send(ws, "input_audio_buffer.append", audio=base64.b64encode(float32_to_pcm16(chunk)).decode())
                await asyncio.sleep(n / 24000 * rng.choice([0.3, 1.0, 1.0, 2.0]))
            elif r < 0.8:
                await send(ws, "input_audio_buffer.clear")
            elif r < 0.85:
                await send(ws, "input_audio_buffer.commit")
            elif r < 0.88:
                await send(ws, "response.cancel")
            elif r < 0.91:  # in the conversation or out of band, with the session's instructions or its own
                await send(ws, "response.create", **rng.choice([{}, {}, {"response": {"instructions": "be brief"}}, {
                    "response": {"conversation": "none", "instructions": "classify", "output_modalities": ["text"]}}]))
            elif r < 0.93:
                answers = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
                item = answers[-1] if answers and rng.random() < 0.7 else "item_x"
                await send(ws, "conversation.item.truncate", item_id=item, content_index=0,
                           audio_end_ms=rng.randint(0, 3000))
            elif r < 0.94:
                items = [e["item"]["id"] for e in events if e["type"] == "conversation.item.added"]
                await send(ws, "conversation.item.delete", item_id=rng.choice(items) if items else "item_x")
            elif r < 0.96:
                await send(ws, "session.update", session={"type": "realtime", "audio": {"input": {
                    "turn_detection": rng.choice(detectors)}}})
            elif r < 0.975:  # a voice, or instructions (they go in after a turn the user is speaking)
                await send(ws, "session.update", session={"type": "realtime", **rng.choice([
                    {"moss": {"voice_prompt": rng.choice(voices)}}, {"instructions": rng.choice(["be brief", "hi"])}])})
            else:
                await user_text(ws, "hello")
        await _still_answers(srv, sid, ws, events, reader)
        return events, ws.close_code


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["fake", "tiny-random"])
async def test_malformed_events_get_client_errors_and_leave_nothing_behind(caplog, engine):
    caplog.set_level(logging.ERROR)  # the real engine on a CPU logs slow steps as warnings
    limits = {"max_sessions": SESSIONS + 1, "max_message_bytes": 256 * 1024}
    with RunningServer(fake_settings(**limits) if engine == "fake" else tiny_settings(**limits)) as srv:
        assert_only_client_errors(await asyncio.gather(*(_fuzz_one(srv, seed) for seed in range(SESSIONS))))
        await assert_engine_idle(srv, caplog)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("detectors", ["server_vad", "semantic_vad"])
async def test_speech_with_random_turn_events_on_the_real_engine(caplog, detectors):
    """VAD turns on real speech, interleaved with every turn and answer event at random: only client errors (a
    response.create mid-speech among them: refused as the client's mistake, never failing inside the engine as a
    server error), and still nothing left behind. With semantic_vad, on speech that pauses mid-turn: answers held
    and withdrawn, and the answer before a withdrawn one cut (the engine takes the cut, never an engine error)."""
    caplog.set_level(logging.ERROR)
    speech, _ = read_wav(SPEECH_WAV, target_rate=24000)
    if detectors == "server_vad":
        signal = np.concatenate([speech, np.zeros(24000, np.float32), 0.5 * speech, np.zeros(30000, np.float32)])
    else:
        paused, _ = read_wav(DATA / "speech_paused_en_16k.wav", target_rate=24000)
        signal = np.concatenate([paused, np.zeros(12000, np.float32), speech, np.zeros(24000, np.float32)])
    choices = SERVER_VAD if detectors == "server_vad" else SEMANTIC_VAD
    with RunningServer(tiny_settings(max_sessions=4)) as srv:
        seconds = 8.0 if detectors == "server_vad" else 10.0
        results = await asyncio.gather(*(_speak_chaotically(srv, seed, signal, seconds, choices) for seed in range(3)))
        assert_only_client_errors(results)
        assert any(e["type"] == "input_audio_buffer.speech_started" for events, _ in results for e in events)
        if detectors == "semantic_vad":  # answers were held, and some withdrawn
            metrics = httpx.get(srv.http + "/metrics", timeout=10).text
            assert re.search(r'^moss_speculative_answers_total\{outcome="withdrawn"\} [1-9]', metrics, re.M), metrics
        await assert_engine_idle(srv, caplog)
