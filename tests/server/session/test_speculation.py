"""Speculative answers in a Session: an answer starts on a tentative end of turn, nothing of it (nor of the turn's
end) reaches the client until the silence confirms the turn, and a withdrawn one is never seen at all. The engine is
the in-memory link of session_support (its replies injected), the end-of-turn model a stand-in."""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import numpy as np
import pytest

from engines.protocol import messages as m
from server.session.session import Session
from server.turn_model import EndOfTurnQueue
from server.vad import VadBatcher
from tests.server.session.session_support import CHUNK, Link, drain, feed, settled, silence, types
from tests.server.session.turn_model_fakes import Model, voice24k

NON_SPECULATIVE_ORDER = [
    "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added",
    "conversation.item.done", "response.created", "response.output_item.added", "conversation.item.added",
    "response.content_part.added", "response.output_audio.delta"]


@pytest.fixture(scope="module")
def speech24k() -> np.ndarray:
    return voice24k()


class Observer:
    def __init__(self) -> None:
        self.speculations: list[tuple[bool, int]] = []
        self.turn_ends: list[float] = []  # silence heard at each turn's end, seconds

    def error(self, code: str) -> None: ...

    def ttfa(self, seconds: float) -> None: ...

    def rtf(self, value: float) -> None: ...

    def underrun(self, seconds: float) -> None: ...

    def speculation(self, withdrawn: bool, wasted_rows: int = 0) -> None:
        self.speculations.append((withdrawn, wasted_rows))

    def turn_end(self, silence_s: float) -> None:
        self.turn_ends.append(silence_s)


async def new_session(turn_detection: dict, model: Model | None = None) -> tuple[Session, Link, Observer]:
    link, obs = Link(), Observer()
    eot = None if model is None else EndOfTurnQueue(load=lambda: model)
    batcher = VadBatcher(end_of_turn=eot, speculative_server_vad=True)
    s = Session("sess_test", link, vad_factory=batcher.stream, observer=obs)
    await s.start()
    await s.handle_client_event({"type": "session.update",
                                 "session": {"audio": {"input": {"turn_detection": turn_detection}}}})
    drain(s)
    return s, link, obs


def answer_begins(s: Session, rid: str) -> None:
    s.on_engine_message(m.ResponseStarted(s.id, rid, 10))
    s.on_engine_message(m.AudioChunk(s.id, rid, CHUNK, 0))


async def paused_with_a_held_answer(speech24k) -> tuple[Session, Link, Observer, str, int]:
    """A server_vad session (500 ms silence) whose user said half a sentence and paused 300 ms: the speculative
    answer has started (its id) and is held; `half` is where the sentence goes on."""
    s, link, obs = await new_session({"type": "server_vad", "silence_duration_ms": 500})
    half = len(speech24k) // 2
    await feed(s, np.concatenate([silence(0.5), speech24k[:half], silence(0.3)]))
    first = link.of(m.CreateResponse)[0].response_id
    answer_begins(s, first)
    return s, link, obs, first, half


async def test_a_held_answer_is_heard_only_once_the_silence_confirms_the_turn(speech24k):
    s, link, obs = await new_session({"type": "server_vad", "silence_duration_ms": 500})
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(0.3)]))
    assert types(drain(s)) == ["input_audio_buffer.speech_started"]
    (commit,) = link.of(m.CommitUserAudio)
    (create,) = link.of(m.CreateResponse)
    assert commit.tentative and link.sent[-1] is create  # the answer started at ~160 ms of silence
    answer_begins(s, create.response_id)
    assert not drain(s)  # its audio is ready, and held
    tentative_at = s.responses.active.playback.turn_start
    await feed(s, silence(0.4))
    await settled(s)
    assert link.of(m.ConfirmUserAudio) and not link.of(m.WithdrawResponse)
    assert s.responses.active.playback.turn_start > tentative_at  # its TTFA counts from the turn end the client saw
    evs = drain(s)
    assert types(evs) == NON_SPECULATIVE_ORDER
    assert evs[2]["item"]["id"] == commit.item_id and evs[4]["response"]["id"] == create.response_id
    assert obs.speculations == [(False, 0)]
    (silence_s,) = obs.turn_ends  # server_vad's 500 ms, in whole 32 ms windows
    assert 0.5 <= silence_s < 0.55, silence_s


async def test_a_withdrawn_answer_is_never_seen_and_the_turn_goes_on(speech24k):
    s, link, obs, first, half = await paused_with_a_held_answer(speech24k)
    (started,) = drain(s)
    appended = len(link.of(m.AppendUserAudio))
    await feed(s, speech24k[half:half + 12000])  # the user goes on
    assert link.of(m.WithdrawResponse) == [m.WithdrawResponse(s.id, first)]
    assert not drain(s)
    # What the user says now waits for the engine to end the withdrawn answer, then continues the turn.
    assert len(link.of(m.AppendUserAudio)) == appended
    s.on_engine_message(m.AudioChunk(s.id, first, CHUNK, 1))  # (late output of it: dropped)
    s.on_engine_message(m.ResponseDone(s.id, first, "cancelled", reason="withdrawn", output_rows=7))
    await settled(s)
    assert len(link.of(m.AppendUserAudio)) > appended
    assert obs.speculations == [(True, 7)]
    await feed(s, np.concatenate([speech24k[half + 12000:], silence(0.3)]))
    second = link.of(m.CreateResponse)[-1].response_id
    assert second != first and link.of(m.CommitUserAudio)[-1].tentative
    answer_begins(s, second)
    await feed(s, silence(0.45))
    await settled(s)
    evs = drain(s)
    assert types(evs) == NON_SPECULATIVE_ORDER
    # One turn, as the client saw it begin; nothing of the withdrawn answer.
    assert evs[0]["item_id"] == evs[1]["item_id"] == started["item_id"]
    assert all(first not in str(e) for e in evs)
    assert [i for i in s.items] == [started["item_id"], evs[6]["item"]["id"]]


@pytest.mark.parametrize("eagerness, held", [("auto", True), ("high", False)])
async def test_semantic_vad_holds_its_answer_by_eagerness(speech24k, eagerness, held):
    model = Model(0.95)
    s, link, obs = await new_session({"type": "semantic_vad", "eagerness": eagerness}, model)
    first_words = speech24k[:int(0.48 * 24000)]
    await feed(s, np.concatenate([silence(0.5), first_words, silence(0.2)]))
    await settled(s)
    (commit,) = link.of(m.CommitUserAudio)
    assert commit.tentative == held
    t = types(drain(s))
    assert ("input_audio_buffer.speech_stopped" in t) != held, t
    if held:
        assert obs.turn_ends == []  # the client has not been told yet
        answer_begins(s, link.of(m.CreateResponse)[0].response_id)
        await feed(s, silence(0.3))
        await settled(s)
        assert types(drain(s)) == NON_SPECULATIVE_ORDER
    # The silence heard when the client was told: auto's confirming 300 ms (whole 32 ms windows); high's at the
    # model's yes, asked at 96 ms of silence and answered once the 200 ms fed had been heard.
    (silence_s,) = obs.turn_ends
    assert 0.3 <= silence_s < 0.36 if held else 0.09 <= silence_s <= 0.2, silence_s


async def test_no_answer_starts_while_a_withdrawn_one_is_still_ending(speech24k):
    """The engine has not yet ended the withdrawn answer: the next pause starts none, nor ends the turn early; the
    turn waits for its silence as without speculation."""
    s, link, _ = await new_session({"type": "server_vad", "silence_duration_ms": 500})
    half = len(speech24k) // 2
    await feed(s, np.concatenate([silence(0.5), speech24k[:half], silence(0.3), speech24k[half:half + 12000]]))
    assert len(link.of(m.WithdrawResponse)) == 1
    await feed(s, silence(0.3))
    assert len(link.of(m.CommitUserAudio)) == 1 and types(drain(s)) == ["input_audio_buffer.speech_started"]
    await feed(s, silence(0.3))  # the silence ends the turn; its answer waits for the withdrawn one to end
    assert types(drain(s))[:2] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed"]
    first = link.of(m.CreateResponse)[0].response_id
    s.on_engine_message(m.ResponseDone(s.id, first, "cancelled", reason="withdrawn"))
    await settled(s)
    assert [c.tentative for c in link.of(m.CommitUserAudio)] == [True, False]
    assert len(link.of(m.CreateResponse)) == 2


async def test_a_held_turn_is_transcribed_as_any_and_no_item_is_deleted_until_it_is_confirmed(speech24k):
    s, link, _ = await new_session({"type": "server_vad", "silence_duration_ms": 500})
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {
        "transcription": {"model": "any"}}}}})
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "id": "earlier", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    drain(s)
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(0.3)]))
    (commit,) = link.of(m.CommitUserAudio)
    assert commit.tentative and commit.transcribe
    rid = link.of(m.CreateResponse)[0].response_id
    answer_begins(s, rid)
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed", output_rows=3))
    await settled(s)
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": "earlier"})
    assert not link.of(m.DeleteItem)  # the turn may still go on: the engine is not asked
    await feed(s, silence(0.4))
    await settled(s)
    assert link.of(m.ConfirmUserAudio)
    errs = [e for e in drain(s) if e["type"] == "error"]
    assert [e["error"]["code"] for e in errs] == ["input_audio_buffer_not_empty"]
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": "earlier"})
    assert link.of(m.DeleteItem) == [m.DeleteItem(s.id, "earlier")]


def text_item(item_id: str) -> dict:
    return {"type": "conversation.item.create", "item": {
        "id": item_id, "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}


async def test_an_item_created_while_the_answer_is_held_stays_when_it_is_withdrawn(speech24k):
    s, link, _, first, half = await paused_with_a_held_answer(speech24k)
    (started,) = drain(s)
    await s.handle_client_event(text_item("typed"))
    # An audio item cannot go in: to the client the user is still speaking.
    audio = base64.b64encode(np.zeros(2400, "<i2").tobytes()).decode()
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio}]}})
    # The audio item's refusal goes out at once (to the client the user still speaks); the text item is held.
    assert [e["error"]["code"] for e in drain(s)] == ["input_audio_buffer_not_empty"]
    assert not link.of(m.AddUserText)
    await feed(s, speech24k[half:half + 12000])  # the user goes on: the answer is withdrawn
    evs = drain(s)
    assert types(evs) == ["conversation.item.added", "conversation.item.done"]
    assert evs[0]["item"]["id"] == "typed" and evs[0]["previous_item_id"] is None
    assert s.items == ["typed"]
    s.on_engine_message(m.ResponseDone(s.id, first, "cancelled", reason="withdrawn", output_rows=7))
    await settled(s)
    withdraw = link.of(m.WithdrawResponse)[0]
    assert link.sent.index(withdraw) < link.sent.index(link.of(m.AddUserText)[0])  # the engine gets it after that
    await feed(s, np.concatenate([speech24k[half + 12000:], silence(0.3)]))
    second = link.of(m.CreateResponse)[-1].response_id
    answer_begins(s, second)
    await feed(s, silence(0.45))
    await settled(s)
    evs = drain(s)
    assert types(evs) == NON_SPECULATIVE_ORDER
    assert evs[1]["item_id"] == started["item_id"] and evs[1]["previous_item_id"] == "typed"
    assert s.items == ["typed", started["item_id"], evs[6]["item"]["id"]]


async def test_no_answer_is_created_over_a_turn_that_may_go_on(speech24k):
    """The held answer ended before the silence confirmed its turn: to the client the user still speaks, so a
    response.create is refused as it is mid-turn, and the turn's answer stands once confirmed."""
    s, link, _ = await new_session({"type": "server_vad", "silence_duration_ms": 500})
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(0.3)]))
    assert types(drain(s)) == ["input_audio_buffer.speech_started"]
    rid = link.of(m.CreateResponse)[0].response_id
    answer_begins(s, rid)
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed", output_rows=3))
    await settled(s)
    await s.handle_client_event({"type": "response.create"})
    assert len(link.of(m.CreateResponse)) == 1
    assert [e["error"]["code"] for e in drain(s)] == ["input_audio_buffer_not_empty"]  # at once
    await feed(s, silence(0.4))
    await settled(s)
    evs = drain(s)
    assert types(evs) == [*NON_SPECULATIVE_ORDER, "response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]


@pytest.mark.parametrize("ended_first", [False, True])
async def test_a_withdrawn_answers_usage_is_not_counted(speech24k, ended_first):
    s, link, obs, first, half = await paused_with_a_held_answer(speech24k)
    done = m.ResponseDone(s.id, first, "completed", output_rows=7, prompt_rows=40)
    if ended_first:  # the answer ended, unseen, before the user went on
        s.on_engine_message(done)
    await feed(s, speech24k[half:half + 12000])
    if not ended_first:
        s.on_engine_message(dataclasses.replace(done, status="cancelled", reason="withdrawn"))
    await settled(s)
    assert link.of(m.WithdrawResponse) and obs.speculations == [(True, 7)]
    assert s.usage_totals == {"input_rows": 0, "output_rows": 0}
    await feed(s, np.concatenate([speech24k[half + 12000:], silence(0.3)]))
    second = link.of(m.CreateResponse)[-1].response_id
    answer_begins(s, second)
    s.on_engine_message(m.ResponseDone(s.id, second, "completed", output_rows=5, prompt_rows=30))
    await feed(s, silence(0.45))
    await settled(s)
    assert s.usage_totals == {"input_rows": 30, "output_rows": 5}


@pytest.mark.parametrize("event, code", [("response.cancel", "response_cancel_not_active"),
                                         ("response.create", "input_audio_buffer_not_empty")])
async def test_a_response_event_while_the_answer_is_held_is_answered_as_the_client_sees_the_turn(speech24k, event,
                                                                                                 code):
    """To the client the user still speaks and no response runs: the error at once, about nothing it never saw; the
    held answer goes on, and is heard once the silence confirms the turn."""
    s, link, _, first, _ = await paused_with_a_held_answer(speech24k)
    drain(s)
    await s.handle_client_event({"type": event})
    evs = drain(s)
    assert [(e["type"], e["error"]["code"]) for e in evs] == [("error", code)]
    assert first not in str(evs) and not link.of(m.CancelResponse) and len(link.of(m.CreateResponse)) == 1
    await feed(s, silence(0.4))
    await settled(s)
    assert types(drain(s)) == NON_SPECULATIVE_ORDER


async def heard_then_held(speech24k, held_ended: bool) -> tuple[Session, Link, str, str, int]:
    """A server_vad session whose first answer was heard and ended; then the user's next turn pauses and its answer
    starts, held (and ends too with `held_ended`: a short answer can end before the silence confirms its turn).
    Returns (s, link, the heard answer's id, the held one's, where the second sentence goes on)."""
    s, link, _ = await new_session({"type": "server_vad", "silence_duration_ms": 500})
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(0.3)]))
    heard = link.of(m.CreateResponse)[0].response_id
    answer_begins(s, heard)
    s.on_engine_message(m.ResponseDone(s.id, heard, "completed", output_rows=3))
    await feed(s, silence(0.4))  # confirmed: the client hears it
    await settled(s)
    drain(s)
    half = len(speech24k) // 2
    await feed(s, np.concatenate([speech24k[:half], silence(0.3)]))  # the next turn pauses: its answer is held
    held = link.of(m.CreateResponse)[-1].response_id
    assert held != heard
    answer_begins(s, held)
    if held_ended:
        s.on_engine_message(m.ResponseDone(s.id, held, "completed", output_rows=3))
    assert types(drain(s)) == ["input_audio_buffer.speech_started"]  # (the turn's end and answer held)
    return s, link, heard, held, half


@pytest.mark.parametrize("held_ended", [False, True])
async def test_clearing_the_heard_answers_audio_while_the_next_is_held_leaves_the_held_one_alone(speech24k, held_ended):
    s, link, heard, held, half = await heard_then_held(speech24k, held_ended)
    await s.handle_client_event({"type": "output_audio_buffer.clear"})
    assert not link.of(m.TruncateResponse) and not link.of(m.CancelResponse)  # the history under the held one stays
    await feed(s, speech24k[half:half + 12000])  # the user goes on: the held answer is withdrawn, never seen
    assert link.of(m.WithdrawResponse) == [m.WithdrawResponse(s.id, held)]
    evs = drain(s)
    assert [(e["type"], e["response_id"]) for e in evs] == [("output_audio_buffer.cleared", heard)]


@pytest.mark.parametrize("held_ended", [False, True])
async def test_truncating_the_heard_item_while_the_next_answer_is_held(speech24k, held_ended):
    """The client's latest item is still the heard answer's: cut short it is refused at once (the held answer was
    made after all of it); cut at its end it is `truncated`, in order once the turn is confirmed, and the held answer
    is heard whole."""
    s, link, heard, held, _ = await heard_then_held(speech24k, held_ended)
    heard_item = next(i for i in s.items if s.item_audio_samples.get(i))
    at_end = s.item_audio_samples[heard_item] * 1000 // 24000
    truncate = {"type": "conversation.item.truncate", "item_id": heard_item, "content_index": 0}
    await s.handle_client_event({**truncate, "audio_end_ms": at_end})
    await s.handle_client_event({**truncate, "audio_end_ms": at_end // 2})
    (refused,) = drain(s)
    assert refused["error"]["code"] == "item_truncate_invalid_item_id" and "next turn" in refused["error"]["message"]
    assert held not in str(refused) and not link.of(m.TruncateResponse)
    await feed(s, silence(0.4))
    await settled(s)
    evs = drain(s)
    assert types(evs)[:len(NON_SPECULATIVE_ORDER)] == NON_SPECULATIVE_ORDER and evs[4]["response"]["id"] == held
    (truncated,) = [e for e in evs if e["type"] == "conversation.item.truncated"]
    assert truncated["item_id"] == heard_item and truncated["audio_end_ms"] == at_end


class GatedLink(Link):
    """A link whose tentative commit waits until the test opens the gate (the engine slow to take it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()

    async def send(self, msg) -> None:
        if isinstance(msg, m.CommitUserAudio) and msg.tentative and not self.gate.is_set():
            self.waiting.set()
            await self.gate.wait()
        await super().send(msg)


@pytest.mark.parametrize("event", [
    {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}},
    {"type": "input_audio_buffer.clear"}])
async def test_new_settings_while_an_answer_is_being_held_still_settle_the_turn(speech24k, event):
    """A turn detection change or a cleared buffer that comes while the speculative answer is still starting (its
    tentative commit on its way to the engine) waits for it, then settles it as it would a held answer: nothing stays
    held for a turn that nobody will confirm any more."""
    link = GatedLink()
    s = Session("sess_test", link, vad_factory=VadBatcher(speculative_server_vad=True).stream)
    await s.start()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "silence_duration_ms": 500}}}}})
    drain(s)
    speaking = asyncio.create_task(feed(s, np.concatenate([silence(0.5), speech24k, silence(0.3)])))
    await asyncio.wait_for(link.waiting.wait(), 30)  # the answer is starting: held, its commit on the way
    changing = asyncio.create_task(s.handle_client_event(event))
    for _ in range(20):
        await asyncio.sleep(0)
    link.gate.set()
    await asyncio.gather(speaking, changing)
    await settled(s)
    assert not s.outbound.holding and s.turns.spec is None
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    await settled(s)
    assert "conversation.item.added" in types(drain(s))  # the client sees what it does again
