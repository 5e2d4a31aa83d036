"""End to end on CPU: a real server on loopback with the real engine process (`engines.process.main`,
tiny-random model and codec), driven over the WebSocket and through the `openai` SDK realtime client.

Answers are capped at a few rows (max_output_tokens) to keep the CPU suite fast.
"""

from __future__ import annotations

import base64
import os
import signal

import numpy as np
import pytest
import websockets

from server.audio.pcm import read_wav
from tests.fakes.harness import RunningServer, recv_event, recv_until, send, start_answer, tiny_settings, user_text
from tests.paths import DATA
from tests.server.e2e_support import b64_chunks

WAV = DATA / "speech_en_16k.wav"
SAMPLES_PER_CODE = 1920  # 24 kHz / 12.5 Hz
ROWS = 6  # answer length cap for these tests (CPU time)


@pytest.fixture(scope="module")
def srv():
    with RunningServer(tiny_settings(drain_timeout_s=1.0)) as s:
        yield s


def speech24k() -> np.ndarray:
    x, _ = read_wav(WAV, target_rate=24000)
    return x


def by_type(evs: list[dict], t: str) -> list[dict]:
    return [e for e in evs if e["type"] == t]


async def _text_session(ws) -> None:
    """Past session.created: text answers of at most ROWS rows, turns ended by the client."""
    await recv_event(ws)
    await send(ws, "session.update", session={"type": "realtime", "output_modalities": ["text"],
                                              "max_output_tokens": ROWS, "audio": {"input": {"turn_detection": None}}})
    await recv_event(ws)


async def test_spoken_turn_with_server_vad(srv):
    async with websockets.connect(srv.ws, max_size=None) as ws:
        assert (await recv_event(ws))["type"] == "session.created"
        await send(ws, "session.update", session={"type": "realtime", "max_output_tokens": ROWS, "audio": {
            "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 400}}}})
        assert (await recv_event(ws))["type"] == "session.updated"
        pcm = np.concatenate([np.zeros(12000, np.float32), speech24k(), np.zeros(24000, np.float32)])
        for chunk in b64_chunks(pcm):
            await send(ws, "input_audio_buffer.append", audio=chunk)
        evs = await recv_until(ws, "response.done", timeout=180)
        t = [e["type"] for e in evs]
        for expected in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "response.created", "response.output_audio.delta"):
            assert expected in t, t
        assert t.index("input_audio_buffer.speech_stopped") < t.index("response.created")
        assert "error" not in t, [e for e in evs if e["type"] == "error"]
        resp = evs[-1]["response"]
        pcm_out = b"".join(base64.b64decode(e["delta"]) for e in by_type(evs, "response.output_audio.delta"))
        samples = len(pcm_out) // 2
        assert samples == resp["moss"]["audio_samples"] > 0
        assert samples % SAMPLES_PER_CODE == 0 and samples <= resp["usage"]["output_tokens"] * SAMPLES_PER_CODE
        assert resp["moss"]["ttfa_ms"] is not None and resp["moss"]["ttfa_ms"] > 0
        assert resp["moss"]["prefilled_rows"] > 0


async def test_text_turns_second_reuses_cached_history(srv):
    async with websockets.connect(srv.ws, max_size=None) as ws:
        await _text_session(ws)
        results = []
        for text in ("Hello, who are you?", "Tell me more."):
            await user_text(ws, text)
            before = srv.engine_stats_now()["prefilled_rows"]
            await send(ws, "response.create")
            evs = await recv_until(ws, "response.done", timeout=180)
            after = srv.engine_stats_now()["prefilled_rows"]
            assert "response.output_audio.delta" not in [e["type"] for e in evs]
            resp = evs[-1]["response"]
            assert resp["output_modalities"] == ["text"]
            assert resp["output"][0]["content"][0]["type"] == "output_text"
            results.append((resp["usage"], resp["moss"], after - before))
        (u1, m1, engine1), (u2, m2, engine2) = results
        # The engine prefilled exactly the rows the response reports, and the second turn only its new rows: the
        # first exchange came from the cache, except the previous answer's last sampled row, which no step had
        # run yet: it goes through the model with the next turn and counts as prefilled there.
        assert engine1 == m1["prefilled_rows"]
        assert m2["prefilled_rows"] == engine2
        assert u2["input_token_details"]["cached_tokens"] == u1["total_tokens"] - 1
        assert 0 < m2["prefilled_rows"] < m1["prefilled_rows"]


async def test_an_out_of_band_answer_leaves_the_next_answers_prompt_as_it_was(srv):
    """Two sessions say the same; one also asks an out-of-band answer (with instructions of its own) between its
    turns. The next answer's prompt (history and new rows) is as long in both: the out-of-band rows, its instructions'
    included, left the engine's history."""
    inputs = []
    for out_of_band in (False, True):
        async with websockets.connect(srv.ws, max_size=None) as ws:
            await _text_session(ws)
            await user_text(ws, "Hello, who are you?")
            await send(ws, "response.create")
            await recv_until(ws, "response.done", timeout=180)
            if out_of_band:
                await send(ws, "response.create", response={"conversation": "none", "output_modalities": ["audio"],
                                                            "max_output_tokens": ROWS,
                                                            "instructions": "Say only yes or no."})
                evs = await recv_until(ws, "response.done", timeout=180)
                assert evs[-1]["response"]["conversation_id"] is None and evs[-1]["response"]["status"] in (
                    "completed", "incomplete")
                assert not by_type(evs, "conversation.item.added") and by_type(evs, "response.output_audio.delta")
            await user_text(ws, "Tell me more.")
            await send(ws, "response.create")
            evs = await recv_until(ws, "response.done", timeout=180)
            assert not by_type(evs, "error"), by_type(evs, "error")
            inputs.append(evs[-1]["response"]["usage"]["input_tokens"])
    assert inputs[0] == inputs[1]


async def test_openai_sdk_realtime_client(srv):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key="unused", base_url=srv.http + "/v1")
    async with client.realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                           "audio": {"input": {"turn_detection": None,
                                                               "format": {"type": "audio/pcm", "rate": 24000}}}})
        for chunk in b64_chunks(speech24k()[: 36000]):  # 1.5 s is enough here
            await conn.input_audio_buffer.append(audio=chunk)
        await conn.input_audio_buffer.commit()
        await conn.response.create(response={"max_output_tokens": ROWS})
        seen: list[str] = []
        audio = 0
        async for event in conn:
            seen.append(event.type)
            if event.type == "error":
                pytest.fail(f"server error: {event.error}")
            if event.type == "response.output_audio.delta":
                audio += len(base64.b64decode(event.delta)) // 2
            if event.type == "response.done":
                assert event.response.status in ("completed", "incomplete")
                assert event.response.usage.output_tokens > 0
                break
    assert seen[0] == "session.created" and "session.updated" in seen and "input_audio_buffer.committed" in seen
    assert "response.output_audio.delta" in seen and audio > 0


async def _start_long_answer(ws) -> str:
    await recv_event(ws)
    await send(ws, "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    await recv_event(ws)
    # min_output_tokens keeps the random model from stopping early: the answer is still running when cancelled.
    evs = await start_answer(ws, "Talk a lot.", max_output_tokens=400, moss={"sampling": {"min_output_tokens": 400}})
    return by_type(evs, "response.created")[0]["response"]["id"]


async def test_cancel_mid_answer_frees_kv(srv):
    async with websockets.connect(srv.ws, max_size=None) as ws:
        rid = await _start_long_answer(ws)
        await send(ws, "response.cancel", response_id=rid)
        evs = await recv_until(ws, "response.done", timeout=60)
        resp = evs[-1]["response"]
        assert resp["status"] == "cancelled" and resp["status_details"]["reason"] == "client_cancelled"
        assert resp["usage"]["output_tokens"] < 400
    st = await srv.wait_engine_idle()
    assert st["running"] == 0 and st["kv_free"] == st["kv_total"], st


async def test_disconnect_mid_answer_frees_kv(srv):
    async with websockets.connect(srv.ws, max_size=None) as ws:
        await _start_long_answer(ws)
        assert srv.engine_stats_now()["running"] == 1
    st = await srv.wait_engine_idle()
    assert st["running"] == 0 and st["sessions"] == 0 and st["kv_free"] == st["kv_total"], st


async def test_engine_killed_mid_session_then_new_session_works(srv):
    async with websockets.connect(srv.ws, max_size=None) as ws:
        await _start_long_answer(ws)
        os.kill(srv.engine().proc.pid, signal.SIGKILL)
        evs = []
        with pytest.raises(websockets.ConnectionClosed) as e:
            while True:
                evs.append(await recv_event(ws, timeout=30))
        assert e.value.rcvd.code == 1011
        assert [x["error"]["code"] for x in evs if x["type"] == "error"][-1] == "engine_unavailable"
    assert srv.wait_engine(ready=True, timeout=300)["engine_restarts"] >= 1
    async with websockets.connect(srv.ws, max_size=None) as ws:
        await recv_event(ws)
        await user_text(ws, "Hi.")
        await send(ws, "response.create", response={"max_output_tokens": ROWS, "output_modalities": ["text"]})
        evs = await recv_until(ws, "response.done", timeout=180)
        assert evs[-1]["response"]["status"] in ("completed", "incomplete")
        assert evs[-1]["response"]["usage"]["output_tokens"] > 0


async def test_transcribed_turn_then_its_item_deleted(srv):
    """A spoken turn with input transcription on: the model's transcript arrives as delta events then completed,
    beside the answer; deleting the turn's item afterwards cuts the engine's history, and the next turn answers."""
    async with websockets.connect(srv.ws, max_size=None) as ws:
        await recv_event(ws)
        await send(ws, "session.update", session={"type": "realtime", "output_modalities": ["text"],
                                                  "max_output_tokens": 3, "audio": {"input": {
                                                      "turn_detection": None,
                                                      "transcription": {"model": "gpt-4o-transcribe"}}}})
        assert (await recv_event(ws))["session"]["audio"]["input"]["transcription"]["model"] == "gpt-4o-transcribe"
        for chunk in b64_chunks(speech24k()[:12000]):  # 0.5 s
            await send(ws, "input_audio_buffer.append", audio=chunk)
        await send(ws, "input_audio_buffer.commit")
        await send(ws, "response.create")
        evs = await recv_until(ws, "response.done", timeout=180)
        item = by_type(evs, "input_audio_buffer.committed")[0]["item_id"]
        done = by_type(evs, "conversation.item.input_audio_transcription.completed")
        if not done:
            evs += await recv_until(ws, "conversation.item.input_audio_transcription.completed", timeout=180)
        assert "error" not in [e["type"] for e in evs], evs
        deltas = by_type(evs, "conversation.item.input_audio_transcription.delta")
        (done,) = by_type(evs, "conversation.item.input_audio_transcription.completed")
        assert {e["item_id"] for e in deltas + [done]} == {item}
        assert done["transcript"] == "".join(e["delta"] for e in deltas).strip() and done["usage"]["output_tokens"]
        await send(ws, "conversation.item.delete", item_id=item)
        assert (await recv_until(ws, "conversation.item.deleted", timeout=60))[-1]["item_id"] == item
        await user_text(ws, "Hello")
        await send(ws, "response.create")
        evs = await recv_until(ws, "response.done", timeout=180)
        assert evs[-1]["response"]["status"] in ("completed", "incomplete")
        assert "error" not in [e["type"] for e in evs], evs
    st = await srv.wait_engine_idle()
    assert st["running"] == 0 and st["kv_free"] == st["kv_total"], st
