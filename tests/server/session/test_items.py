"""A Session's message items of several text parts, item deletion, truncation setting and input transcription events,
against a recording engine link (engine replies injected with on_engine_message)."""

from __future__ import annotations

import base64
from dataclasses import replace

import numpy as np

from engines.protocol import messages as m
from server.session.client_events import SessionConfig, parse_session_update
from server.session.session import Session, SessionLimits
from tests.server.session.session_support import Link, drain, respond, settled, types

SPEECH = base64.b64encode((np.sin(np.arange(12000) / 7.0) * 8000).astype("<i2").tobytes()).decode()


async def ptt_session() -> tuple[Session, Link]:
    link = Link()
    s = Session("sess_items", link)  # no VAD: the client commits its turns
    await s.start()
    drain(s)
    return s, link


async def spoken_turn(s: Session) -> str:
    await s.handle_client_event({"type": "input_audio_buffer.append", "audio": SPEECH})
    await s.handle_client_event({"type": "input_audio_buffer.commit"})
    return s.items[-1]


async def answer(s: Session, link: Link) -> str:
    await s.handle_client_event({"type": "response.create"})
    cr = link.of(m.CreateResponse)[-1]
    s.on_engine_message(m.ResponseStarted(s.id, cr.response_id, 3))
    s.on_engine_message(m.ResponseDone(s.id, cr.response_id, "completed"))
    await settled(s)
    assert cr.item_id == s.items[-1]  # the engine knows the answer by its item
    return cr.item_id


def test_truncation_settings_parse_and_refuse_bad_values():
    cur = SessionConfig()
    assert cur.truncation == "auto"
    assert parse_session_update({"truncation": "disabled"}, cur) == (replace(cur, truncation="disabled"), [])
    ratio = {"type": "retention_ratio", "retention_ratio": 0.5}
    assert parse_session_update({"truncation": ratio}, cur) == (replace(cur, truncation=ratio), [])
    for bad, param in [({"type": "retention_ratio", "retention_ratio": 0}, "session.truncation.retention_ratio"),
                       ({"type": "retention_ratio", "retention_ratio": True}, "session.truncation.retention_ratio"),
                       ({"type": "other"}, "session.truncation.type"), ("sometimes", "session.truncation")]:
        # refused by name, and the rest of the update applies
        new, refused = parse_session_update({"truncation": bad, "instructions": "Be brief."}, cur)
        assert new == replace(cur, instructions="Be brief.") and [e.param for e in refused] == [param]
    t, refused = parse_session_update({"audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe"}}}},
                                      cur)
    assert refused == []
    assert t.transcription == {"model": "gpt-4o-mini-transcribe", "language": None, "prompt": None}


async def test_truncation_reaches_the_engine_only_when_it_changes():
    s, link = await ptt_session()
    await s.handle_client_event({"type": "session.update", "session": {"truncation": "auto"}})
    assert not link.of(m.SetTruncation)
    await s.handle_client_event({"type": "session.update", "session": {
        "truncation": {"type": "retention_ratio", "retention_ratio": 0.5}}})
    await s.handle_client_event({"type": "session.update", "session": {"truncation": "disabled"}})
    assert [x.retention_ratio for x in link.of(m.SetTruncation)] == [0.5, None]
    assert drain(s)[-1]["session"]["truncation"] == "disabled"


async def test_transcription_events_follow_the_engine_in_order():
    s, link = await ptt_session()
    await spoken_turn(s)
    assert not link.of(m.CommitUserAudio)[-1].transcribe  # no transcription unless set
    await s.handle_client_event({"type": "session.update", "session": {
        "audio": {"input": {"transcription": {"model": "whisper-1"}}}}})
    assert drain(s)[-1]["session"]["audio"]["input"]["transcription"]["model"] == "whisper-1"
    item = await spoken_turn(s)
    commit = link.of(m.CommitUserAudio)[-1]
    assert commit.transcribe and commit.item_id == item
    drain(s)
    s.on_engine_message(m.TranscriptionDelta(s.id, item, "Hello"))
    s.on_engine_message(m.TranscriptionDelta(s.id, item, " there"))
    s.on_engine_message(m.TranscriptionDone(s.id, item, "completed", "Hello there", prompt_rows=40, output_rows=3))
    evs = drain(s)
    assert types(evs) == ["conversation.item.input_audio_transcription.delta"] * 2 + [
        "conversation.item.input_audio_transcription.completed"]
    assert [e["delta"] for e in evs[:2]] == ["Hello", " there"]
    done = evs[2]
    assert (done["item_id"], done["content_index"], done["transcript"]) == (item, 0, "Hello there")
    assert done["usage"] == {"type": "tokens", "input_tokens": 40, "output_tokens": 3, "total_tokens": 43}
    s.on_engine_message(m.TranscriptionDone(s.id, item, "failed", code="server_busy", reason="queue full"))
    (failed,) = drain(s)
    assert failed["type"] == "conversation.item.input_audio_transcription.failed"
    assert failed["error"] == {"type": "server_error", "code": "server_busy", "message": "queue full", "param": None}


async def test_item_delete_is_checked_then_sent_and_deleted_when_the_engine_says():
    s, link = await ptt_session()
    user = await spoken_turn(s)
    bot = await answer(s, link)
    drain(s)
    await s.handle_client_event({"type": "conversation.item.delete", "event_id": "e1", "item_id": "missing"})
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": user, "extra": 1})
    errs = drain(s)
    assert [e["error"]["code"] for e in errs] == ["item_delete_invalid_item_id", "unknown_parameter"]
    assert errs[0]["error"]["event_id"] == "e1" and not link.of(m.DeleteItem)
    # During an answer: refused.
    await s.handle_client_event({"type": "response.create"})
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": user})
    assert drain(s)[-1]["error"]["code"] == "conversation_already_has_active_response"
    cr = link.of(m.CreateResponse)[-1]
    s.on_engine_message(m.ResponseDone(s.id, cr.response_id, "completed"))
    await settled(s)
    drain(s)
    # Uncommitted audio in the buffer: refused.
    await s.handle_client_event({"type": "input_audio_buffer.append", "audio": SPEECH})
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": user})
    assert drain(s)[-1]["error"]["code"] == "input_audio_buffer_not_empty"
    await s.handle_client_event({"type": "input_audio_buffer.clear"})
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": user})
    await settled(s)
    assert link.of(m.DeleteItem) == [m.DeleteItem(s.id, user)]
    assert user in s.items  # until the engine has cut its history
    drain(s)
    s.on_engine_message(m.ItemsDropped(s.id, [user], deleted=True))
    assert [(e["type"], e["item_id"]) for e in drain(s)] == [("conversation.item.deleted", user)]
    assert user not in s.items and bot in s.items
    # Items the engine dropped to fit its context are deleted the same way.
    s.on_engine_message(m.ItemsDropped(s.id, [bot], deleted=False))
    assert [(e["type"], e["item_id"]) for e in drain(s)] == [("conversation.item.deleted", bot)]


async def test_texts_over_the_bound_are_refused_on_arrival_and_the_session_goes_on():
    """The engine's bound on a text (MOSS_MAX_TEXT_CHARS) is checked as the event arrives: the engine is not sent
    the text, the client gets `input_too_large` naming the field, and what was set stays."""
    link = Link()
    s = Session("sess_items", link, limits=SessionLimits(max_text_chars=20))
    await s.start()
    await s.handle_client_event({"type": "session.update", "session": {"instructions": "Be brief."}})
    drain(s)
    for role, ptype in (("user", "input_text"), ("system", "input_text"), ("assistant", "output_text")):
        await s.handle_client_event({"type": "conversation.item.create", "event_id": "e", "item": {
            "type": "message", "role": role, "content": [{"type": ptype, "text": "x" * 21}]}})
        (err,) = drain(s)
        assert (err["error"]["code"], err["error"]["param"], err["error"]["event_id"]) == (
            "input_too_large", "item.content[0].text", "e")
    await s.handle_client_event({"type": "session.update", "session": {"instructions": "y" * 21, "truncation": {
        "type": "retention_ratio", "retention_ratio": 0.5}}})
    err, updated = drain(s)
    assert (err["error"]["code"], err["error"]["param"]) == ("input_too_large", "session.instructions")
    assert updated["session"]["instructions"] == "Be brief." and updated["session"]["truncation"]["retention_ratio"]
    assert not link.of(m.AddUserText) and [u.instructions for u in link.of(m.UpdateSession)] == ["Be brief."]
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 20}]}})
    assert [a.text for a in link.of(m.AddUserText)] == ["x" * 20] and s.items


async def test_a_message_of_several_text_parts_is_one_text_a_line_each():
    """LiveKit sends a chat message's strings as the text parts of one item; the engine gets them as one text and the
    client sees the parts it sent."""
    s, link = await ptt_session()
    for role, ptype in (("system", "input_text"), ("user", "input_text"), ("assistant", "output_text"),
                        ("user", "text")):
        await s.handle_client_event({"type": "conversation.item.create", "item": {
            "type": "message", "role": role, "content": [{"type": ptype, "text": "Hello."},
                                                         {"type": ptype, "text": "How are you?"}]}})
        added = [e for e in drain(s) if e["type"] == "conversation.item.added"]
        assert [p["text"] for p in added[0]["item"]["content"]] == ["Hello.", "How are you?"]
    assert [(a.role, a.text) for a in link.of(m.AddUserText)] == [
        (role, "Hello.\nHow are you?") for role in ("system", "user", "assistant", "user")]
    assert len(s.items) == 4


async def test_parts_that_cannot_make_one_item_are_refused_by_name():
    s, link = await ptt_session()
    part = {"type": "input_text", "text": "hi"}
    audio = {"type": "input_audio", "audio": SPEECH}
    for content, code, param in (
            ([], "invalid_item", "item.content"),
            ([part, audio], "unsupported_content_type", "item.content[1].type"),
            ([audio, part], "unsupported_content_type", "item.content[0].type"),
            ([audio, audio], "unsupported_content_type", "item.content"),
            ([part, {"type": "input_text", "text": ""}], "invalid_item", "item.content[1].text"),
            ([part, {"type": "input_text", "text": "x" * 20}], "input_too_large", "item.content")):
        s.limits = replace(s.limits, max_text_chars=21)
        await s.handle_client_event({"type": "conversation.item.create", "event_id": "e", "item": {
            "type": "message", "role": "user", "content": content}})
        (err,) = drain(s)
        assert (err["error"]["code"], err["error"]["param"]) == (code, param), content
    assert not s.items and not link.of(m.AddUserText) and not link.of(m.AppendUserAudio)


async def text_item(s: Session) -> str:
    """A user text item (it waits in the engine to go in with the next answer)."""
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "and then?"}]}})
    return s.items[-1]


def truncate(item_id: str, ms: int) -> dict:
    return {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": ms}


async def test_an_answer_after_an_item_that_left_is_cut_only_at_its_end():
    """Deleting an item before the latest answer makes the engine prefill the answer's rows again, and it can no
    longer cut them: a truncate short of the answer's end is refused as the client's (before the engine hears of
    it), one at its end is confirmed, and output_audio_buffer.clear stops its audio without a cut; deleting an item
    after the answer leaves it to be cut as usual."""
    s, link = await ptt_session()
    user = await spoken_turn(s)
    await respond(s, link)  # an audio answer of two chunks (800 ms)
    bot = link.of(m.CreateResponse)[-1].item_id
    later = await text_item(s)
    drain(s)
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": later})
    s.on_engine_message(m.ItemsDropped(s.id, [later], deleted=True))
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": user})
    s.on_engine_message(m.ItemsDropped(s.id, [user], deleted=True))
    drain(s)
    await s.handle_client_event(truncate(bot, 100))
    assert [e["error"]["code"] for e in drain(s)] == ["item_truncate_invalid_item_id"]
    assert not link.of(m.TruncateResponse)
    await s.handle_client_event(truncate(bot, 800))  # at its end: nothing to cut
    assert [(e["type"], e.get("audio_end_ms")) for e in drain(s)] == [("conversation.item.truncated", 800)]
    await s.handle_client_event({"type": "output_audio_buffer.clear"})  # its audio stops; the history keeps it
    assert types(drain(s)) == ["output_audio_buffer.cleared"]
    assert not link.of(m.TruncateResponse)


async def test_an_answer_is_cut_only_at_its_end_as_soon_as_an_item_before_it_is_deleted():
    """The engine takes the deletion first, so a cut sent before it says the items left would reach an answer whose
    rows have moved (the engine refuses it: not the latest answer)."""
    s, link = await ptt_session()
    user = await spoken_turn(s)
    await respond(s, link)
    bot = link.of(m.CreateResponse)[-1].item_id
    drain(s)
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": user})
    await s.handle_client_event(truncate(bot, 100))
    assert [e["error"]["code"] for e in drain(s)] == ["item_truncate_invalid_item_id"]
    await s.handle_client_event({"type": "output_audio_buffer.clear"})
    assert types(drain(s)) == ["output_audio_buffer.cleared"]
    assert link.of(m.DeleteItem) and not link.of(m.TruncateResponse)


async def test_an_answer_with_only_later_items_deleted_is_cut_as_usual():
    s, link = await ptt_session()
    await spoken_turn(s)
    await respond(s, link)  # an audio answer of two chunks (800 ms)
    bot = link.of(m.CreateResponse)[-1].item_id
    later = await text_item(s)
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": later})
    s.on_engine_message(m.ItemsDropped(s.id, [later], deleted=True))
    drain(s)
    await s.handle_client_event(truncate(bot, 100))
    assert [(e["type"], e.get("audio_end_ms")) for e in drain(s)] == [("conversation.item.truncated", 100)]
    assert link.of(m.TruncateResponse)[-1].audio_samples_played == 2400
