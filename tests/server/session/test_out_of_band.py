"""`response.create` with `conversation: "none"`: an answer outside the conversation. The client gets the response's
own events (its output item included) and no conversation item; the conversation's latest answer stays what it was
and can no longer be cut short; the out-of-band item can be neither truncated nor retrieved.

An in-memory engine link records what the session sends (tests/server/session/session_support.py)."""

from __future__ import annotations

import pytest

from engines.protocol import messages as m
from tests.server.session.session_support import drain, new_session, respond, settled
from tests.server.strict_events import check


async def _out_of_band(s, link, **response) -> tuple[str, list[dict]]:
    await s.handle_client_event({"type": "response.create", "response": {"conversation": "none", **response}})
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseStarted(s.id, rid, prompt_rows=3))
    s.on_engine_message(m.TextDelta(s.id, rid, "yes"))
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed", output_rows=2, prompt_rows=3))
    await settled(s)
    return rid, [e for e in drain(s) if isinstance(e, dict)]


async def test_an_out_of_band_response_has_its_events_and_no_conversation_item():
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    drain(s)
    rid, evs = await _out_of_band(s, link, output_modalities=["text"], metadata={"purpose": "classify"})
    assert link.of(m.CreateResponse)[-1].out_of_band
    for e in evs:
        check(e)
    kinds = [e["type"] for e in evs]
    assert "conversation.item.added" not in kinds and "conversation.item.done" not in kinds
    assert {"response.output_item.added", "response.output_item.done", "response.output_text.done"} <= set(kinds)
    created, done = evs[kinds.index("response.created")], evs[-1]
    assert created["response"]["conversation_id"] is None and done["response"]["conversation_id"] is None
    assert done["response"]["status"] == "completed" and done["response"]["metadata"] == {"purpose": "classify"}
    item = done["response"]["output"][0]["id"]
    assert item not in s.items
    await s.handle_client_event({"type": "conversation.item.retrieve", "item_id": item})
    assert drain(s)[0]["error"]["code"] == "item_retrieve_invalid_item_id"


async def test_the_conversations_answer_stays_the_latest_but_is_cut_only_at_its_end():
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    await respond(s, link, chunks=2)  # 0.8 s of answer in the conversation
    answer = s.responses.last.item_id
    drain(s)
    oob, evs = await _out_of_band(s, link)
    oob_item = evs[-1]["response"]["output"][0]["id"]
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": oob_item, "content_index": 0,
                                 "audio_end_ms": 0})
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": answer, "content_index": 0,
                                 "audio_end_ms": 300})
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": answer, "content_index": 0,
                                 "audio_end_ms": 800})
    await settled(s)
    evs = drain(s)
    assert [(e["type"], e.get("error", {}).get("code")) for e in evs] == [
        ("error", "item_truncate_invalid_item_id"), ("error", "item_truncate_invalid_item_id"),
        ("conversation.item.truncated", None)]
    assert not link.of(m.TruncateResponse)


@pytest.mark.parametrize(("value", "code"), [("my_conv", "invalid_value"), (3, "invalid_value")])
async def test_a_conversation_other_than_auto_or_none_is_refused(value, code):
    s, link = await new_session()
    await s.handle_client_event({"type": "response.create", "response": {"conversation": value}})
    err = drain(s)[-1]
    assert (err["error"]["code"], err["error"]["param"]) == (code, "response.conversation")
    assert not link.of(m.CreateResponse)
