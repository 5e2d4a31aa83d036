"""The /v1/realtime client events, against a real server with the scripted fake engine: turns, event shapes, client
mistakes (an `error` and the session goes on), the input buffer.

The fake engine (tests/fakes/fake_engine.py) has fixed, documented rules, so these tests check what the
server does with engine messages independently of the model. End-to-end tests with the real engine are in
tests/server/test_e2e.py; the server around sessions (auth, limits, supervision, drain) in tests/server/test_serving.py.
"""

from __future__ import annotations

import base64
import json

import pytest

from server.session.client_json import ProtocolError, decode_client_event
from server.session.json_depth import MAX_DEPTH, deeper_than
from tests.fakes.harness import RunningServer, fake_settings, recv_event, recv_until, send
from tests.server.realtime_support import KEY, by_type, connect, open_session, text_turn, tone_b64


@pytest.fixture(scope="module")
def srv():
    settings = fake_settings(api_keys=[KEY], max_message_bytes=64 * 1024, max_input_buffer_seconds=5.0)
    with RunningServer(settings) as s:
        yield s


async def test_text_turn_then_second_turn_prefills_only_new_rows(srv):
    async with connect(srv.ws + "?model=gpt-realtime") as ws:
        session = await open_session(ws)
        assert session["type"] == "realtime" and session["audio"]["input"]["turn_detection"] is None
        first = await text_turn(ws, "hello there friend")
        types = [e["type"] for e in first]
        assert types[:2] == ["conversation.item.added", "conversation.item.done"]
        assert "response.created" in types and "response.output_audio.delta" not in types
        assert all("event_id" in e and "type" in e for e in first)
        deltas = by_type(first, "response.output_text.delta")
        done_text = by_type(first, "response.output_text.done")[0]["text"]
        assert deltas and "".join(d["delta"] for d in deltas) == done_text
        resp = first[-1]["response"]
        assert resp["status"] == "completed" and resp["output"][0]["content"][0] == {"type": "output_text",
                                                                                     "text": done_text}
        # The fake engine adds words + 4 rows per text item; nothing else was in the history.
        assert resp["moss"]["prefilled_rows"] == 3 + 4
        assert resp["usage"]["input_token_details"]["cached_tokens"] == 0
        history = resp["usage"]["total_tokens"]

        second = await text_turn(ws, "and again")
        usage = second[-1]["response"]["usage"]
        assert second[-1]["response"]["moss"]["prefilled_rows"] == 2 + 4  # only the new item
        assert usage["input_token_details"]["cached_tokens"] == history


async def test_audio_turn_with_client_commit(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        for _ in range(10):
            await send(ws, "input_audio_buffer.append", audio=tone_b64(0.1))
        await send(ws, "input_audio_buffer.commit", event_id="c1")
        evs = await recv_until(ws, "conversation.item.done")
        committed = by_type(evs, "input_audio_buffer.committed")[0]
        item = by_type(evs, "conversation.item.added")[0]["item"]
        assert item["id"] == committed["item_id"] and item["role"] == "user"
        assert item["content"][0]["type"] == "input_audio"
        await send(ws, "response.create")
        evs = await recv_until(ws, "response.done")
        audio = b"".join(base64.b64decode(e["delta"]) for e in by_type(evs, "response.output_audio.delta"))
        resp = evs[-1]["response"]
        assert len(audio) // 2 == resp["moss"]["audio_samples"] > 0
        # Fake engine: 16000 samples -> 12 full codes + a partial one closed by the commit, + 4 commit rows.
        assert resp["moss"]["prefilled_rows"] == 12 + 1 + 4
        assert resp["moss"]["ttfa_ms"] is not None and resp["moss"]["ttfa_ms"] > 0
        first_delta = by_type(evs, "response.output_audio.delta")[0]
        assert set(first_delta) == {"event_id", "type", "response_id", "item_id", "output_index", "content_index",
                                    "delta"}
        transcript = by_type(evs, "response.output_audio_transcript.done")[0]["transcript"]
        assert transcript == "".join(e["delta"] for e in by_type(evs, "response.output_audio_transcript.delta"))
        # A second commit with nothing appended is a client error; the session survives.
        await send(ws, "input_audio_buffer.commit", event_id="c2")
        err = await recv_event(ws)
        assert err["error"]["code"] == "input_audio_buffer_commit_empty" and err["error"]["event_id"] == "c2"


@pytest.mark.parametrize("raw, code, param", [
    ("{not json", "invalid_json", None),
    (json.dumps({"type": "response.frobnicate", "event_id": "e1"}), "unknown_event", "type"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}), "invalid_audio", "audio"),
    (json.dumps({"type": "session.update", "session": {"type": "realtime", "temperature": 0.5}}),
     "unknown_parameter", "session.temperature"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "near_field_vad"}}}}}), "unsupported_turn_detection", "session.audio.input.turn_detection.type"),
    (json.dumps({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}),
     "unsupported_parameter", "session.tools"),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active", None),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": ""}]}}), "invalid_audio", "item.content[0].audio"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "function_call"}}),
     "unsupported_item_type", "item.type"),
    # A lone surrogate is valid JSON syntax but no UTF-8 text: refused here, before it can reach an engine message.
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_text", "text": "hi \\ud800"}]}}', "invalid_json", None),
    ('{"type": "session.update", "session": {"instructions": "\\udfff"}}', "invalid_json", None),
    ('{"type": "session.update", "session": {"type": "realtime", "max_output_tokens": NaN}}', "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
    # Nested past the decoder's recursion limit: this closed the socket with 1006 (an unhandled RecursionError).
    ("[" * 60000, "invalid_json", None),
    ('{"type": "session.update", "session": {"instructions": ' + "[" * 5000 + "]" * 5000 + "}}", "invalid_json", None),
])
async def test_client_mistakes_get_error_events_and_session_survives(srv, raw, code, param):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await ws.send(raw)
        err = await recv_event(ws)
        assert err["type"] == "error", err
        assert err["error"]["code"] == code and err["error"]["param"] == param, err
        if '"event_id": "e1"' in raw:
            assert err["error"]["event_id"] == "e1"
        evs = await text_turn(ws, "still there")
        assert evs[-1]["response"]["status"] == "completed"


async def test_commit_of_audio_still_inside_the_resampler_is_not_empty(srv):
    """4 ms at 24 kHz is less than the 24 -> 16 kHz resampler's delay, so nothing has reached the engine when the
    commit comes: the commit flushes it and the turn is committed (this was refused as an empty buffer)."""
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await send(ws, "input_audio_buffer.commit", event_id="c0")
        assert (await recv_event(ws))["error"]["code"] == "input_audio_buffer_commit_empty"
        await send(ws, "input_audio_buffer.append", audio=tone_b64(0.004))
        await send(ws, "input_audio_buffer.commit", event_id="c1")
        evs = await recv_until(ws, "input_audio_buffer.committed")
        assert not by_type(evs, "error"), evs


async def test_response_create_with_uncommitted_audio_is_refused_until_commit(srv):
    """The engine holds a turn's audio as it arrives and would fail an answer started before the commit; the
    server refuses it as the client's mistake instead (no response.created, no failed response)."""
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await send(ws, "input_audio_buffer.append", audio=tone_b64(0.2))
        await send(ws, "response.create", event_id="r1")
        err = await recv_event(ws)
        assert err["type"] == "error" and err["error"]["code"] == "input_audio_buffer_not_empty", err
        assert err["error"]["event_id"] == "r1" and "200 ms" in err["error"]["message"]
        await send(ws, "input_audio_buffer.commit")
        await recv_until(ws, "input_audio_buffer.committed")
        await send(ws, "response.create")
        evs = await recv_until(ws, "response.done")
        assert evs[-1]["response"]["status"] == "completed"
        assert len(by_type(evs, "response.created")) == 1


def test_decode_client_event_keeps_escaped_text_and_refuses_lone_surrogates():
    from server.session.client_json import ProtocolError, decode_client_event

    pair = decode_client_event('{"type": "x", "text": "\\ud83d\\ude00 caf\\u00e9"}')  # escaped as json.dumps does
    assert pair["text"] == "\U0001f600 caf\u00e9"
    assert decode_client_event(b'{"type": "x"}') == {"type": "x"}  # a binary data channel message
    for bad in ('{"type": "x", "t": "\\ud83d"}', '{"\\udc00": 1}', '{"type": "x", "l": ["\\ude00a"]}',
                b'{"type": "x", "t": "\\ud800"}', '{"v": Infinity}', b'\xff\xfe'):
        with pytest.raises(ProtocolError) as e:
            decode_client_event(bad)
        assert e.value.code == "invalid_json", bad


def test_nesting_is_bounded_outside_strings_only():
    for text in ("[" * 100000, '{"a": ' * 5000 + "1" + "}" * 5000, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)):
        assert deeper_than(text) and deeper_than(text.encode())
        with pytest.raises(ProtocolError) as e:
            decode_client_event(text)
        assert e.value.code == "invalid_json" and "deep" in e.value.message
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert not deeper_than(deepest) and decode_client_event('{"v": ' + deepest[2:-2] + "}")
    # Brackets in strings, escaped quotes and backslashes included, are text, not nesting.
    inside = r'{"type": "x", "text": "' + "[{" * 500 + r'\\ \"' + "[" * 200 + '"}'
    assert not deeper_than(inside) and decode_client_event(inside)["text"].endswith('"' + "[" * 200)
    escaped_backslash_then_open = r'{"t": "\\", "v": ' + "[" * 70 + "]" * 70 + "}"
    assert deeper_than(escaped_backslash_then_open)


async def test_input_buffer_limit(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        for _ in range(2):
            await send(ws, "input_audio_buffer.append", audio=tone_b64(1.0))
        # 5 s limit: 2 s + 1 s fits twice... the fourth second-long append pushes over 5 s on the sixth.
        for _ in range(3):
            await send(ws, "input_audio_buffer.append", audio=tone_b64(1.0))
        await send(ws, "input_audio_buffer.append", audio=tone_b64(1.0), event_id="over")
        err = await recv_event(ws)
        assert err["error"]["code"] == "input_audio_buffer_too_large" and err["error"]["event_id"] == "over"
        await send(ws, "input_audio_buffer.clear")
        assert (await recv_event(ws))["type"] == "input_audio_buffer.cleared"


async def test_audio_item_create(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await send(ws, "conversation.item.create", item={"id": "my_item", "type": "message", "role": "user",
                                                         "content": [{"type": "input_audio", "audio": tone_b64(1.0)}]})
        evs = await recv_until(ws, "conversation.item.done")
        assert evs[0]["type"] == "conversation.item.added" and evs[0]["item"]["id"] == "my_item"
        assert evs[0]["item"]["content"][0]["type"] == "input_audio"
        await send(ws, "response.create")
        done = (await recv_until(ws, "response.done"))[-1]["response"]
        assert done["moss"]["prefilled_rows"] == 12 + 1 + 4  # same rows as 1 s appended and committed


async def test_an_item_goes_at_the_root_only_while_the_conversation_is_empty(srv):
    """`previous_item_id: "root"` is the conversation's start (LiveKit creates the first item of an agent's context
    so): taken while that is also its end; later, inserting there is refused by name."""
    async with connect(srv.ws) as ws:
        await open_session(ws)
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        await send(ws, "conversation.item.create", previous_item_id="root", item=item)
        added = (await recv_until(ws, "conversation.item.added"))[-1]
        assert added["previous_item_id"] is None
        await recv_until(ws, "conversation.item.done")
        await send(ws, "conversation.item.create", previous_item_id="root", item=item)
        err = await recv_event(ws)
        assert (err["error"]["code"], err["error"]["param"]) == ("unsupported_previous_item_id", "previous_item_id")
