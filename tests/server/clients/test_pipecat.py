"""Pipecat's OpenAIRealtimeLLMService on its defaults (only the base URL and key changed) in a headless pipeline fed
from a WAV: two spoken turns answered with audio, a barge-in, no error; and a greeting asked for by the context."""

from __future__ import annotations

import asyncio

import numpy as np
from pipecat.frames.frames import (
    ErrorFrame,
    InputAudioRawFrame,
    LLMFullResponseEndFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

from server.audio.pcm import float32_to_pcm16
from tests.server.clients.conftest import KEY, utterance
from tests.server.clients.events import Seen, at_real_time

WATCHED = (ErrorFrame, LLMFullResponseEndFrame, TTSAudioRawFrame, TTSStartedFrame)


class Watch(FrameProcessor):
    """Passes every frame on; notes the ones the test waits on (errors travel upstream, answers downstream)."""

    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.seen = seen

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, WATCHED):
            self.seen.add(frame)
        await self.push_frame(frame, direction)


class ReadyService(OpenAIRealtimeLLMService):
    """The service as it is, telling the test when the server has taken its session settings."""

    def __init__(self, seen: Seen, **kw) -> None:
        super().__init__(**kw)
        self.seen = seen

    async def _handle_evt_session_updated(self, evt) -> None:
        await super()._handle_evt_session_updated(evt)
        self.seen.add("session.updated")


def frames(pcm24k: np.ndarray, ms: int = 100) -> list[InputAudioRawFrame]:
    step = 24 * ms
    return [InputAudioRawFrame(audio=float32_to_pcm16(pcm24k[i:i + step]), sample_rate=24000, num_channels=1)
            for i in range(0, len(pcm24k), step)]


def is_error(x) -> bool:
    return isinstance(x, ErrorFrame)


def count(items: list, kind: type) -> int:
    return sum(isinstance(x, kind) for x in items)


async def test_two_spoken_turns_and_a_barge_in(srv, speech24k):
    seen = Seen()
    llm = ReadyService(seen, api_key=KEY, base_url=srv.ws)
    worker = PipelineWorker(Pipeline([Watch(seen), llm, Watch(seen)]), idle_timeout_secs=None)
    runner = asyncio.create_task(WorkerRunner(handle_sigint=False).run(worker))

    async def speak() -> None:
        await at_real_time(frames(utterance(speech24k)), lambda f: worker.queue_frame(f), 0.1)

    try:
        await seen.until(lambda items: "session.updated" in items, "the session set up")
        for n in (1, 2):
            await speak()
            await seen.until(lambda items, n=n: count(items, LLMFullResponseEndFrame) == n, f"answer {n}",
                             failed=is_error)
        assert count(seen.items, TTSAudioRawFrame) > 0 and count(seen.items, TTSStartedFrame) == 2
        # Barge-in: the user talks over the third answer as soon as it is heard.
        start = len(seen.items)
        await speak()
        await seen.until(lambda items: count(items[start:], TTSAudioRawFrame), "answer 3's audio", failed=is_error)
        await speak()
        await seen.until(lambda items: count(items, LLMFullResponseEndFrame) == 4, "the barge-in turn's answer",
                         failed=is_error)
        end3 = [i for i, x in enumerate(seen.items) if isinstance(x, LLMFullResponseEndFrame)][2]
        assert count(seen.items[end3:], TTSAudioRawFrame) > 0  # the barge-in turn was answered with audio
    finally:
        await worker.cancel()
        await runner
    assert not count(seen.items, ErrorFrame), [x for x in seen.items if isinstance(x, ErrorFrame)]


async def test_a_context_that_asks_for_a_greeting(srv):
    """Pipecat's way to have the bot speak first: a context with a user message, then LLMRunFrame. The service creates
    the context's items and asks for the answer: it comes, with audio, and no error."""
    from pipecat.frames.frames import LLMRunFrame
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair

    seen = Seen()
    llm = ReadyService(seen, api_key=KEY, base_url=srv.ws)
    context = LLMContext([{"role": "user", "content": "Say hello to the user."}])
    aggregators = LLMContextAggregatorPair(context)
    worker = PipelineWorker(Pipeline([Watch(seen), aggregators.user(), llm, Watch(seen), aggregators.assistant()]),
                            idle_timeout_secs=None)
    runner = asyncio.create_task(WorkerRunner(handle_sigint=False).run(worker))
    try:
        await worker.queue_frame(LLMRunFrame())
        await seen.until(lambda items: count(items, LLMFullResponseEndFrame) == 1, "the greeting", failed=is_error)
        assert count(seen.items, TTSAudioRawFrame) > 0
    finally:
        await worker.cancel()
        await runner
    assert not count(seen.items, ErrorFrame), [x for x in seen.items if isinstance(x, ErrorFrame)]
