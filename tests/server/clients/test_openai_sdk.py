"""The openai SDK's realtime client on its defaults (only the base URL and key changed) against the real server: an
ephemeral key from client_secrets.create, two spoken turns answered with audio, a barge-in, no error."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from openai import AsyncOpenAI

from server.audio.pcm import float32_to_pcm16
from tests.server.clients.conftest import KEY, utterance
from tests.server.clients.events import Seen, at_real_time


def chunks(pcm24k: np.ndarray, ms: int = 100) -> list[str]:
    step = 24 * ms
    return [base64.b64encode(float32_to_pcm16(pcm24k[i:i + step])).decode() for i in range(0, len(pcm24k), step)]


def of(items: list, etype: str) -> list:
    return [e for e in items if e.type == etype]


async def test_two_spoken_turns_and_a_barge_in(srv, speech24k):
    secret = await AsyncOpenAI(api_key=KEY, base_url=srv.http + "/v1").realtime.client_secrets.create()
    client = AsyncOpenAI(api_key=secret.value, base_url=srv.http + "/v1")  # what a browser app holds
    seen = Seen()
    async with client.realtime.connect(model="gpt-realtime") as conn:
        async def read() -> None:
            async for event in conn:
                seen.add(event)

        async def speak() -> None:
            await at_real_time(chunks(utterance(speech24k)), lambda c: conn.input_audio_buffer.append(audio=c), 0.1)

        async def answered(start: int, what: str) -> None:
            """Until the answer to the first turn that ends after `start` is done."""
            def done(items: list) -> bool:
                stopped = [i for i, e in enumerate(items[start:]) if e.type == "input_audio_buffer.speech_stopped"]
                created = [e.response.id for e in of(items[start + stopped[0]:], "response.created")] if stopped \
                    else []
                return any(e.response.id in created for e in of(items[start:], "response.done"))

            await seen.until(done, what)

        reader = asyncio.create_task(read())
        talking: asyncio.Task | None = None
        try:
            for n in (1, 2):
                start = len(seen.items)
                await speak()
                await answered(start, f"answer {n}")
                evs = seen.items[start:]
                assert of(evs, "response.done")[0].response.status == "completed"
                assert of(evs, "response.output_audio.delta") and of(evs, "input_audio_buffer.committed")
            # Barge-in: talk over the third answer; on speech_started stop playing it and tell the server what was
            # heard, as an SDK user does.
            start = len(seen.items)
            await speak()
            await seen.until(lambda items: of(items[start:], "response.output_audio.delta"), "answer 3's audio")
            first_audio = time.monotonic()
            item_id = of(seen.items[start:], "response.output_audio.delta")[0].item_id
            barge = len(seen.items)
            talking = asyncio.create_task(speak())
            await seen.until(lambda items: of(items[barge:], "input_audio_buffer.speech_started"), "the barge-in")
            got_ms = sum(len(base64.b64decode(e.delta)) for e in of(seen.items[start:], "response.output_audio.delta")
                         if e.item_id == item_id) // 48
            played_ms = min(int((time.monotonic() - first_audio) * 1000), got_ms)
            await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=played_ms)
            await seen.until(lambda items: of(items[barge:], "conversation.item.truncated"), "the truncation")
            await talking
            await answered(barge, "the barge-in turn's answer")
        finally:
            reader.cancel()
            if talking is not None:
                talking.cancel()
    assert not of(seen.items, "error"), of(seen.items, "error")
    answers = [e.response for e in of(seen.items[start:], "response.done")]
    assert len(answers) == 2 and answers[1].status == "completed", answers
    assert answers[0].status in ("completed", "cancelled")  # cancelled when it was still being generated
    assert of(seen.items[barge:], "response.output_audio.delta")
