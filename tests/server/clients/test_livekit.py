"""LiveKit Agents' openai.realtime.RealtimeModel on its defaults (only the base URL and key changed; semantic_vad,
input transcription asked for, max_response_output_tokens "inf"), its session driven without a room: two spoken
turns answered with audio and completed, a barge-in as AgentSession does it (interrupt, truncate), no error; a
greeting asked for with `generate_reply(instructions=...)`; an earlier conversation given with `update_chat_ctx`."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
from livekit import rtc
from livekit.plugins import openai as lk_openai

from server.audio.pcm import float32_to_pcm16
from tests.server.clients.conftest import KEY, utterance
from tests.server.clients.events import Seen, at_real_time
from tests.server.strict_events import check


def frames(pcm24k: np.ndarray, ms: int = 100) -> list[rtc.AudioFrame]:
    step = 24 * ms
    return [rtc.AudioFrame(float32_to_pcm16(pcm24k[i:i + step]), 24000, 1, len(pcm24k[i:i + step]))
            for i in range(0, len(pcm24k) - step + 1, step)]


def server(items: list, etype: str) -> list[dict]:
    return [x for x in items if isinstance(x, dict) and x.get("type") == etype]


def bad(x) -> bool:
    """An error the session emitted (input transcription, asked for by default, included: the server transcribes)."""
    return isinstance(x, tuple) and x[0] == "error"


async def test_two_spoken_turns_and_a_barge_in(srv, speech24k):
    seen = Seen()
    tasks: list[asyncio.Task] = []

    async def audio_of(gen) -> None:
        async for msg in gen.message_stream:
            async for frame in msg.audio_stream:
                seen.add(("audio", msg.message_id, frame.samples_per_channel))

    async with aiohttp.ClientSession() as http:
        model = lk_openai.realtime.RealtimeModel(api_key=KEY, base_url=srv.http + "/v1", http_session=http)
        session = model.session()
        session.on("openai_server_event_received", seen.add)
        session.on("error", lambda e: seen.add(("error", e)))
        session.on("generation_created", lambda gen: tasks.append(asyncio.ensure_future(audio_of(gen))))

        async def speak() -> None:
            async def push(frame: rtc.AudioFrame) -> None:
                session.push_audio(frame)

            # LiveKit asks for semantic_vad (eagerness auto): the end-of-turn model is unsure at the end of this
            # synthetic speech, so the turn ends at auto's longest wait for it, 4 s of silence.
            await at_real_time(frames(utterance(speech24k, silence_s=4.5)), push, 0.1)

        try:
            await seen.until(lambda items: server(items, "session.updated"), "the session set up", failed=bad)
            for n in (1, 2):
                await speak()
                await seen.until(lambda items, n=n: len(server(items, "response.done")) == n, f"answer {n}",
                                 failed=bad)
            assert [d["response"]["status"] for d in server(seen.items, "response.done")] == ["completed"] * 2
            assert sum(1 for x in seen.items if isinstance(x, tuple) and x[0] == "audio") > 0
            # Barge-in, as AgentSession does it: on speech start, interrupt the answer and truncate it where the
            # listener is.
            start = len(seen.items)
            await speak()
            await seen.until(lambda items: any(isinstance(x, tuple) and x[0] == "audio" for x in items[start:]),
                             "answer 3's audio", failed=bad)
            first_audio = time.monotonic()
            message_id = next(x[1] for x in seen.items[start:] if isinstance(x, tuple) and x[0] == "audio")
            barge = len(seen.items)
            talking = asyncio.ensure_future(speak())
            await seen.until(lambda items: server(items[barge:], "input_audio_buffer.speech_started"),
                             "the barge-in's speech", failed=bad)
            session.interrupt()
            got_ms = sum(x[2] for x in seen.items[start:] if isinstance(x, tuple) and x[0] == "audio"
                         and x[1] == message_id) // 24
            session.truncate(message_id=message_id, modalities=["audio"],
                             audio_end_ms=min(got_ms, int((time.monotonic() - first_audio) * 1000)))
            await talking
            await seen.until(lambda items: len(server(items, "response.done")) == 4, "the barge-in turn's answer",
                             failed=bad)
            await seen.until(lambda items: server(items, "conversation.item.input_audio_transcription.completed"),
                             "a turn's transcription", failed=bad)
        finally:
            await session.aclose()
            for t in tasks:
                t.cancel()
    assert not [x for x in seen.items if bad(x)]
    assert all(u["session"]["audio"]["input"]["transcription"] for u in server(seen.items, "session.updated"))
    for e in seen.items:  # what the real engine's answers made of every event, checked as the SDK's models
        if isinstance(e, dict):
            check(e)
    statuses = [d["response"]["status"] for d in server(seen.items, "response.done")]
    assert statuses[3] == "completed" and statuses[2] in ("completed", "cancelled"), statuses
    assert server(seen.items[barge:], "conversation.item.truncated") or statuses[2] == "completed"


async def _answered(srv, ask) -> tuple[Seen, object]:
    """A LiveKit session (no room) in which `ask(session)` leads to one answer: its events and what `ask` returned,
    no error among them."""
    seen = Seen()
    async with aiohttp.ClientSession() as http:
        model = lk_openai.realtime.RealtimeModel(api_key=KEY, base_url=srv.http + "/v1", http_session=http)
        session = model.session()
        session.on("openai_server_event_received", seen.add)
        session.on("error", lambda e: seen.add(("error", e)))
        try:
            result = await ask(session)
            await seen.until(lambda items: server(items, "response.done"), "the answer", failed=bad)
        finally:
            await session.aclose()
    assert not [x for x in seen.items if bad(x)]
    return seen, result


async def test_generate_reply_with_instructions_of_its_own(srv):
    """`generate_reply(instructions=...)`, how LiveKit's agents greet a user: a response.create with instructions of
    its own (the session's and the new ones together) is answered, and resolves the client's generation."""
    async def greet(session):
        await session.update_instructions("You are a helpful voice assistant.")
        return await asyncio.wait_for(session.generate_reply(instructions="Greet the user."), 60)

    seen, generation = await _answered(srv, greet)
    done = server(seen.items, "response.done")
    assert [d["response"]["status"] for d in done] == ["completed"]
    assert generation.response_id == done[0]["response"]["id"]


async def test_an_agents_earlier_conversation_is_given_to_the_session(srv):
    """An agent that starts with a conversation (a chat context restored from elsewhere) has LiveKit create its items
    one after the other, the first at `previous_item_id: "root"`: all are taken, in order, and answered from (a
    message of several strings is an item of several text parts)."""
    from livekit.agents import llm

    ctx = llm.ChatContext()
    ctx.add_message(role="user", content="My name is Ada.")
    ctx.add_message(role="assistant", content="Nice to meet you, Ada.")
    ctx.add_message(role="user", content=["Tell me.", "What is my name?"])

    async def resume(session):
        await asyncio.wait_for(session.update_chat_ctx(ctx), 30)
        return await asyncio.wait_for(session.generate_reply(), 60)

    seen, _ = await _answered(srv, resume)
    added = [e["item"] for e in server(seen.items, "conversation.item.added")]
    assert [(i["role"], [p.get("text") for p in i["content"]]) for i in added[:3]] == [
        ("user", ["My name is Ada."]), ("assistant", ["Nice to meet you, Ada."]),
        ("user", ["Tell me.", "What is my name?"])]
    assert [d["response"]["status"] for d in server(seen.items, "response.done")] == ["completed"]
