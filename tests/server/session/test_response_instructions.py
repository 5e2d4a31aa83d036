"""A response's own instructions (`response.instructions`, what LiveKit Agents' `generate_reply(instructions=...)`
sends): the engine is given them as a system turn just before the answer and the session's instructions again just
after it, before anything the client sent while it ran; an out-of-band answer's go with it alone (they leave the
engine's history with it); instructions back to null mean the default prompt again.

An in-memory engine link records what the session sends (tests/server/session/session_support.py)."""

from __future__ import annotations

import pytest

from engines.protocol import messages as m
from tests.server.session.session_support import drain, new_session, settled


def _text(text: str) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def _inputs(link) -> list:
    """The conversation inputs the engine got, in order, as (kind, detail)."""
    out = []
    for x in link.sent:
        if isinstance(x, m.UpdateSession):
            out.append(("instructions", x.instructions, x.default_instructions, x.pinned))
        elif isinstance(x, m.CreateResponse):
            out.append(("create", x.response_id) if x.instructions is None else
                       ("create", x.response_id, x.instructions))
        elif isinstance(x, m.AddUserText):
            out.append(("text", x.text))
    return out


async def _session(instructions: str | None):
    s, link = await new_session()
    update = {"audio": {"input": {"turn_detection": None}}, **({"instructions": instructions} if instructions else {})}
    await s.handle_client_event({"type": "session.update", "session": update})
    link.sent.clear()
    drain(s)
    return s, link


async def test_an_answers_instructions_go_in_before_it_and_the_sessions_after_it():
    s, link = await _session("You are kind.")
    await s.handle_client_event(_text("hi"))
    await s.handle_client_event({"type": "response.create", "response": {
        "output_modalities": ["text"], "instructions": "You are kind.\nGreet the user."}})
    rid = link.of(m.CreateResponse)[-1].response_id
    await s.handle_client_event(_text("sent while it ran"))  # held until the answer ends
    s.on_engine_message(m.ResponseStarted(s.id, rid, prompt_rows=10))
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed", output_rows=3))
    await settled(s)
    assert _inputs(link) == [
        ("text", "hi"), ("instructions", "You are kind.\nGreet the user.", None, False), ("create", rid),
        ("instructions", "You are kind.", None, False), ("text", "sent while it ran")]
    assert s.config.instructions == "You are kind."  # the session's own never changed
    assert not [e for e in drain(s) if e["type"] in ("error", "session.updated")]


async def test_without_session_instructions_the_default_prompt_of_the_answers_modality_comes_back():
    s, link = await _session(None)
    await s.handle_client_event({"type": "response.create", "response": {"instructions": "Say hello."}})
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed"))
    await settled(s)
    assert _inputs(link) == [("instructions", "Say hello.", None, False), ("create", rid),
                             ("instructions", None, "audio", False)]


async def test_an_out_of_band_answers_instructions_go_with_it_alone():
    s, link = await _session("You are kind.")
    await s.handle_client_event({"type": "response.create", "response": {
        "conversation": "none", "output_modalities": ["text"], "instructions": "Classify the user's mood."}})
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed", output_rows=3))
    await settled(s)
    assert _inputs(link) == [("create", rid, "Classify the user's mood.")]
    assert not [e for e in drain(s) if e["type"] == "error"]


@pytest.mark.parametrize("same", [None, "", "You are kind."])
async def test_the_sessions_own_instructions_or_none_change_nothing(same):
    s, link = await _session("You are kind.")
    await s.handle_client_event({"type": "response.create", "response": {"instructions": same}})
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed"))
    await settled(s)
    assert _inputs(link) == [("create", rid)]


async def test_an_answer_cancelled_before_the_engine_saw_it_leaves_the_sessions_instructions_last():
    """Held behind an answer still running, then cancelled: the session's instructions take its place in the queue,
    after its own (never before them, which would leave its own as the session's)."""
    s, link = await _session("You are kind.")
    await s.handle_client_event({"type": "response.create"})
    first = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseDone(s.id, first, "completed"))
    s.engine_inputs._engine_busy = True  # as while the engine still owes a withdrawn answer's end: inputs wait
    await s.handle_client_event({"type": "response.create", "response": {"instructions": "Shout."}})
    await s.handle_client_event({"type": "response.cancel"})
    assert [e["response"]["status"] for e in drain(s) if e["type"] == "response.done"][-1] == "cancelled"
    s.engine_inputs.answer_ended()
    await settled(s)
    assert _inputs(link)[1:] == [("instructions", "Shout.", None, False),
                                 ("instructions", "You are kind.", None, False)]


async def test_instructions_that_are_no_string_or_too_long_are_the_clients_error():
    s, link = await _session(None)
    for bad, code in ((["a"], "invalid_value"), ("x" * (s.limits.max_text_chars + 1), "input_too_large")):
        await s.handle_client_event({"type": "response.create", "event_id": "e", "response": {"instructions": bad}})
        err = [e for e in drain(s) if e["type"] == "error"]
        assert [(e["error"]["code"], e["error"]["param"]) for e in err] == [(code, "response.instructions")]
    assert not link.of(m.CreateResponse) and not link.of(m.UpdateSession)


async def test_session_instructions_back_to_null_are_the_default_prompt_again():
    s, link = await _session("You are kind.")
    await s.handle_client_event({"type": "session.update", "session": {"instructions": None,
                                                                       "output_modalities": ["text"]}})
    assert _inputs(link) == [("instructions", None, "text", True)]
    assert drain(s)[-1]["session"]["instructions"] is None
