"""`audio.output.speed`: answers played faster or slower at the same pitch. What the client gets and cuts is the
answer as played; the engine's history is cut at the model's own samples under it.

An in-memory engine link records what the session sends (tests/server/session/session_support.py)."""

from __future__ import annotations

import base64

import pytest

from engines.protocol import messages as m
from tests.server.session.session_support import CHUNK, drain, new_session, respond, settled
from tests.server.strict_events import check


async def _at_speed(speed):
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": None}, "output": {"speed": speed}}}})
    return s, link, check(drain(s)[-1])


@pytest.mark.parametrize("speed", [0.5, 1.25])
async def test_an_answer_at_a_speed_is_sent_one_over_speed_as_long(speed):
    s, link, updated = await _at_speed(speed)
    assert updated.session.audio.output.speed == speed
    await respond(s, link, chunks=4)
    evs = drain(s)
    sent = sum(len(base64.b64decode(e["delta"])) // 2 for e in evs if e["type"] == "response.output_audio.delta")
    made = 4 * len(CHUNK) // 2
    assert sent == pytest.approx(made / speed, rel=0.01)
    assert s.responses.last.audio_samples_queued == sent


async def test_a_cut_is_where_the_listener_is_in_what_was_played_and_the_models_samples_under_it():
    s, link, _ = await _at_speed(0.5)
    await respond(s, link, chunks=4)  # 1.6 s made, 3.2 s played
    item = s.responses.last.item_id
    drain(s)
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": item, "content_index": 0,
                                 "audio_end_ms": 2000})
    await settled(s)
    assert link.of(m.TruncateResponse)[-1].audio_samples_played == 24000  # 2 s heard: the model's first second
    truncated = [e for e in drain(s) if e["type"] == "conversation.item.truncated"]
    assert truncated[0]["audio_end_ms"] == 2000
    # Past the end as played is refused; within it (3.2 s at half speed), not.
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": item, "content_index": 0,
                                 "audio_end_ms": 3300})
    assert [e["error"]["code"] for e in drain(s) if e["type"] == "error"] == ["invalid_value"]


@pytest.mark.parametrize(("speed", "ok"), [(0.25, True), (1.5, True), (None, True), (2.0, False), (0.1, False),
                                           ("fast", False), (True, False)])
async def test_the_apis_range_is_taken_and_anything_else_refused_by_name(speed, ok):
    s, _ = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"output": {"speed": speed}}}})
    evs = [check(e) for e in drain(s)]
    errors = [(e.error.code, e.error.param) for e in evs if e.type == "error"]
    assert errors == ([] if ok else [("invalid_value", "session.audio.output.speed")])
    assert evs[-1].session.audio.output.speed == (speed if ok and speed is not None else 1.0)


async def test_on_a_track_the_played_position_is_the_listeners_and_the_cut_the_models():
    s, link = await new_session(audio_out="track")
    await s.handle_client_event({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": None}, "output": {"speed": 1.25}}}})
    await s.handle_client_event({"type": "response.create"})
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseStarted(s.id, rid, prompt_rows=10))
    for i in range(3):
        s.on_engine_message(m.AudioChunk(s.id, rid, CHUNK, i))
    track = []
    while len(s.outbound):  # the track takes them
        x = await s.outbound.get()
        track += [] if isinstance(x, dict) else [x]
    played = sum(len(a.pcm24k) // 2 for a in track)
    assert 3 * 9600 / 1.25 - 1440 <= played <= 3 * 9600 / 1.25  # all but the filter's window (~60 ms) so far
    s.audio_played(rid, 12000)  # half a second heard
    await s.handle_client_event({"type": "output_audio_buffer.clear"})
    await settled(s)
    assert link.of(m.TruncateResponse)[-1].audio_samples_played == 15000  # 0.625 s of the model's audio
