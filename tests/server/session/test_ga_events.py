"""What clients written for OpenAI's GA Realtime API rely on, on an in-process Session: every server event validates
under the openai SDK's strict models, session.update applies what it can, barge-in truncation,
conversation.item.retrieve, output_audio_buffer.clear, idle_timeout_ms, answers the server's length limit ends."""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from engines.protocol import messages as m
from server.session import server_events as ev
from server.session.pacing import AudioOut
from tests.server.session.session_support import CHUNK, drain, feed, new_session, respond, settled, silence, types
from tests.server.strict_events import SERVER_EVENT_TYPES, check

NO_VAD = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}
HI = {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "hi"}]}}


async def taken(s) -> list:
    """What the transport takes off the outbound stream now (answer audio counts as sent, unlike drain)."""
    return [await s.outbound.get() for _ in range(len(s.outbound))]


def audio_items(items: list) -> list:
    return [x for x in items if isinstance(x, AudioOut)]


async def test_every_server_event_validates_under_the_sdk_models(speech24k):
    seen: list[dict] = []

    def take(s) -> list:
        items = drain(s)
        seen.extend(x for x in items if isinstance(x, dict))
        return items

    s, link = await new_session()
    seen.append(ev.session_event("session.created", s.id, s.config))
    await s.handle_client_event({"type": "session.update", "session": {
        "model": "gpt-realtime", "tools": [{"type": "function", "name": "f"}],
        "audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 6000}}}}})
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))  # a VAD turn, answered
    take(s)
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseStarted(s.id, rid, prompt_rows=10))
    s.on_engine_message(m.TextDelta(s.id, rid, "hello"))
    s.on_engine_message(m.AudioChunk(s.id, rid, CHUNK, 0))
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed", output_rows=5, audio_samples=9600))
    await settled(s)
    item_id = [e for e in take(s) if e["type"] == "response.done"][0]["response"]["output"][0]["id"]
    await s.idle._trigger()  # the idle timer's work (its timing: test_idle_timeout_...)
    await s.handle_client_event({"type": "response.cancel"})  # the answer the timeout asked for; then an error
    s.on_engine_message(m.ResponseDone(s.id, link.of(m.CreateResponse)[-1].response_id, "cancelled"))
    await s.handle_client_event({"type": "response.cancel"})
    await s.handle_client_event({"type": "conversation.item.retrieve", "item_id": item_id})
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                                 "audio_end_ms": 100})
    await s.handle_client_event(NO_VAD)
    await s.handle_client_event(HI)
    await respond(s, link, "text")
    pcm = base64.b64encode((speech24k[:4800] * 32767).astype("<i2").tobytes()).decode()
    await s.handle_client_event({"type": "input_audio_buffer.append", "audio": pcm})
    await s.handle_client_event({"type": "input_audio_buffer.clear"})
    await s.handle_client_event({"type": "input_audio_buffer.append", "audio": pcm})
    await s.handle_client_event({"type": "input_audio_buffer.commit"})
    await respond(s, link, status=None)
    await s.handle_client_event({"type": "output_audio_buffer.clear"})
    take(s)

    t, s2 = await new_session(audio_out="track")  # barge-in on a track: conversation.item.truncated
    await feed(t, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    await respond(t, s2, status=None)
    t.audio_played(s2.of(m.CreateResponse)[-1].response_id, 4800)
    await feed(t, np.concatenate([silence(0.2), speech24k[:24000]]))
    take(t)

    # A turn's transcription (completed, and one that failed) and the item deleted, as the engine reports them.
    user_item = t.items[0]
    t.on_engine_message(m.TranscriptionDelta(t.id, user_item, "hel"))
    t.on_engine_message(m.TranscriptionDone(t.id, user_item, "completed", text="hello"))
    t.on_engine_message(m.TranscriptionDone(t.id, user_item, "failed", code="server_busy", reason="no KV room"))
    t.on_engine_message(m.ItemsDropped(t.id, [user_item], deleted=True))
    await settled(t)
    take(t)

    for e in seen:
        check(e)
    missing = SERVER_EVENT_TYPES - {e["type"] for e in seen} - {"output_audio_buffer.started",
                                                                 "output_audio_buffer.stopped"}
    assert not missing, f"not covered here (WebRTC's output_audio_buffer.started/stopped: test_webrtc): {missing}"


async def test_session_update_applies_every_field_it_can_and_names_each_refused_one():
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "event_id": "u1", "session": {
        "type": "realtime", "model": "gpt-realtime", "instructions": "Be brief.", "frobnicate": 1,
        "audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe"},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 700, "threshold": 7}},
                  "output": {"voice": "marin", "speed": 2.0}}}})  # (past 1.5)
    evs = drain(s)
    errs = [e["error"] for e in evs if e["type"] == "error"]
    assert sorted(e["param"] for e in errs) == ["session.audio.input.turn_detection.threshold",
                                                "session.audio.output.speed", "session.frobnicate"], errs
    assert all(e["event_id"] == "u1" for e in errs)
    assert evs[-1]["type"] == "session.updated"
    sess = evs[-1]["session"]
    assert sess["model"] == "moss-speech"  # the served model, whatever was asked for
    assert sess["instructions"] == "Be brief." and sess["audio"]["output"]["voice"] == "marin"
    td = sess["audio"]["input"]["turn_detection"]
    assert td["silence_duration_ms"] == 700 and td["threshold"] == 0.5
    assert link.of(m.UpdateSession)[-1].instructions == "Be brief."


async def test_vad_barge_in_on_a_track_truncates_where_the_listener_is_and_says_so(speech24k):
    for mode in ("track", "events"):
        s, link = await new_session(audio_out=mode)
        await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
        rid = await respond(s, link, chunks=3, status=None)
        item_id = [e for e in await taken(s) if isinstance(e, dict) and e["type"] == "response.output_item.added"][0][
            "item"]["id"]
        s.audio_played(rid, 4800)  # the track has played 200 ms
        await feed(s, np.concatenate([silence(0.2), speech24k[:24000]]))
        evs = [e for e in drain(s) if isinstance(e, dict)]
        truncate = link.of(m.TruncateResponse)[-1]
        if mode == "track":
            assert truncate.audio_samples_played == 4800
            t = types(evs)
            assert t.index("input_audio_buffer.speech_started") < t.index("conversation.item.truncated")
            tr = evs[t.index("conversation.item.truncated")]
            assert tr["audio_end_ms"] == 200 and tr["item_id"] == item_id
        else:  # over a WebSocket only the client knows what it played: it sends conversation.item.truncate
            assert "conversation.item.truncated" not in types(evs)


async def test_barge_in_after_the_answer_ended_cuts_what_the_track_has_not_played(speech24k):
    s, link = await new_session(audio_out="track")
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    rid = await respond(s, link, chunks=3)  # generated to the end; 1.2 s of it queued for the track
    assert audio_items(await taken(s))
    s.audio_played(rid, 9600)
    await feed(s, np.concatenate([silence(0.2), speech24k[:24000]]))
    (truncate,) = link.of(m.TruncateResponse)
    assert truncate.response_id == rid and truncate.audio_samples_played == 9600
    tr = [e for e in drain(s) if isinstance(e, dict) and e["type"] == "conversation.item.truncated"]
    assert [e["audio_end_ms"] for e in tr] == [400]
    # Heard to the end: nothing to cut.
    s, link = await new_session(audio_out="track")
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    rid = await respond(s, link, chunks=3)
    await taken(s)
    s.audio_played(rid, 3 * 9600)
    await feed(s, np.concatenate([silence(0.2), speech24k[:24000]]))
    assert not link.of(m.TruncateResponse)
    assert "conversation.item.truncated" not in types(drain(s))
    # The user's turn before it deleted meanwhile: the engine's history keeps the answer whole (its rows are
    # prefilled again there), nothing is said to be cut.
    s, link = await new_session(audio_out="track")
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    rid = await respond(s, link, chunks=3)
    await taken(s)
    s.audio_played(rid, 9600)
    user = s.items[0]
    await s.handle_client_event({"type": "conversation.item.delete", "item_id": user})
    s.on_engine_message(m.ItemsDropped(s.id, [user], deleted=True))
    await feed(s, np.concatenate([silence(0.2), speech24k[:24000]]))
    assert not link.of(m.TruncateResponse)
    assert "conversation.item.truncated" not in types(drain(s))


async def test_output_audio_buffer_clear_over_the_websocket_stops_the_answer_where_it_is_heard():
    s, link = await new_session()
    await s.handle_client_event(NO_VAD)
    await s.handle_client_event(HI)
    rid = await respond(s, link, chunks=4, status=None)
    await s.handle_client_event({"type": "output_audio_buffer.clear", "event_id": "c1"})
    assert link.of(m.CancelResponse)[-1].response_id == rid
    assert link.of(m.TruncateResponse)[-1].audio_samples_played == 0  # none of it left the server
    evs = drain(s)
    assert "response.output_audio.delta" not in types(evs)
    assert [e["response_id"] for e in evs if e["type"] == "output_audio_buffer.cleared"] == [rid]


async def test_conversation_item_retrieve():
    s, link = await new_session()
    await s.handle_client_event(NO_VAD)
    await s.handle_client_event(HI)
    await respond(s, link)
    done = [e for e in drain(s) if e["type"] == "conversation.item.done"]
    for d in done:
        await s.handle_client_event({"type": "conversation.item.retrieve", "item_id": d["item"]["id"]})
        (got,) = drain(s)
        assert got["type"] == "conversation.item.retrieved" and got["item"] == d["item"]
    await s.handle_client_event({"type": "conversation.item.retrieve", "item_id": "item_nope", "event_id": "r9"})
    (err,) = drain(s)
    assert err["error"]["code"] == "item_retrieve_invalid_item_id" and err["error"]["event_id"] == "r9"
    await s.handle_client_event({"type": "conversation.item.retrieve"})
    (err,) = drain(s)
    assert (err["error"]["code"], err["error"]["message"]) == ("item_retrieve_invalid_item_id",
                                                                "item_id (a string) is required")


async def test_an_earlier_assistant_item_can_be_truncated_only_at_its_end():
    s, link = await new_session()
    await s.handle_client_event(NO_VAD)
    for _ in range(2):
        await s.handle_client_event(HI)
        await respond(s, link, chunks=2)
    first = [e for e in drain(s) if e["type"] == "response.done"][0]["response"]["output"][0]["id"]
    n = len(link.sent)
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": first, "content_index": 0,
                                 "audio_end_ms": 900})
    (tr,) = drain(s)
    assert tr["type"] == "conversation.item.truncated" and tr["audio_end_ms"] == 800 and len(link.sent) == n
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": first, "content_index": 0,
                                 "audio_end_ms": 300})
    assert drain(s)[0]["error"]["code"] == "item_truncate_invalid_item_id"


async def test_idle_timeout_commits_the_silence_and_answers_after_the_answer_was_heard(speech24k):
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "idle_timeout_ms": 5000}}}}})
    assert drain(s)[-1]["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"] == 5000
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    rid = link.of(m.CreateResponse)[-1].response_id
    assert s.idle._timer is None  # not while the answer runs
    s.on_engine_message(m.ResponseStarted(s.id, rid, prompt_rows=10))
    s.on_engine_message(m.AudioChunk(s.id, rid, CHUNK, 0))
    loop = asyncio.get_running_loop()
    before = loop.time()
    s.on_engine_message(m.ResponseDone(s.id, rid, "completed", output_rows=5, audio_samples=9600))
    # Due once the answer's 0.4 s of audio has played, plus the 5 s.
    assert before + 5.4 - 0.05 <= s.idle._timer.when() <= loop.time() + 5.4
    await feed(s, silence(0.3))
    drain(s)
    await s.idle._trigger()
    evs = drain(s)
    t = types(evs)
    assert t[:2] == ["input_audio_buffer.timeout_triggered", "input_audio_buffer.committed"], t
    assert "response.created" in t
    trig = evs[0]
    # The silent stretch it demarcates: the last 5 s of input, or all of it when there is less.
    assert trig["audio_end_ms"] == s.turns.position_ms
    assert trig["audio_start_ms"] == max(0, s.turns.position_ms - 5000)
    assert evs[1]["item_id"] == trig["item_id"]
    # Speech disarms it.
    s.idle.arm(0.0)
    await feed(s, np.concatenate([silence(0.2), speech24k[:24000]]))
    assert s.idle._timer is None


async def test_trailing_audio_after_a_vad_turn_does_not_block_an_answer(speech24k):
    """A VAD turn, 20 ms more of the mic, then push to talk: the trailing audio only ever reached the VAD's prefix
    ring, so response.create goes ahead (it was refused as input_audio_buffer_not_empty)."""
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "create_response": False}}}}})
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    pcm = base64.b64encode((silence(0.02) * 32767).astype("<i2").tobytes()).decode()
    await s.handle_client_event({"type": "input_audio_buffer.append", "audio": pcm})
    await s.handle_client_event(NO_VAD)
    drain(s)
    await s.handle_client_event({"type": "response.create"})
    assert "response.created" in types(drain(s)) and link.of(m.CreateResponse)


async def test_an_answer_with_no_client_limit_that_reaches_the_server_limit_completes():
    s, link = await new_session(max_answer_rows=5)
    await s.handle_client_event(NO_VAD)
    await s.handle_client_event(HI)
    await respond(s, link, status="incomplete", reason="max_output_tokens")
    assert link.of(m.CreateResponse)[-1].sampling.max_new_tokens == 5
    done = [e for e in drain(s) if e["type"] == "response.done"][0]["response"]
    assert done["status"] == "completed" and done["status_details"] is None
    assert done["moss"]["stopped_by"] == "max_answer_rows"
    # A limit the client set is still reported as such.
    await s.handle_client_event({"type": "response.create", "response": {"max_output_tokens": 3}})
    rid = link.of(m.CreateResponse)[-1].response_id
    s.on_engine_message(m.ResponseDone(s.id, rid, "incomplete", reason="max_output_tokens"))
    done = [e for e in drain(s) if e["type"] == "response.done"][0]["response"]
    assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
    assert "stopped_by" not in done["moss"]


async def test_truncating_the_previous_answer_once_a_later_one_runs_cuts_nothing_or_is_refused():
    """Clients that track playback loosely truncate the answer they last played after the next one began (Pipecat
    does on speech_started): at its end that cuts nothing and is confirmed; a real cut is refused (the engine's
    history has moved on), and nothing reaches the engine either way."""
    s, link = await new_session()
    await s.handle_client_event(NO_VAD)
    await s.handle_client_event(HI)
    await respond(s, link, chunks=2)
    item_id = [e for e in drain(s) if e["type"] == "response.done"][0]["response"]["output"][0]["id"]
    await s.handle_client_event(HI)
    await respond(s, link, status=None)  # running
    drain(s)
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                                 "audio_end_ms": 800})
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                                 "audio_end_ms": 300})
    done, refused = drain(s)
    assert done["type"] == "conversation.item.truncated" and done["audio_end_ms"] == 800
    assert refused["error"]["code"] == "item_truncate_invalid_item_id"
    assert not link.of(m.TruncateResponse)
