"""The /v1/realtime protocol, limits and supervision, against a real server with the scripted fake engine.

The fake engine (tests/fakes/fake_engine.py) has fixed, documented rules, so these tests check what the
server does with engine messages (event shapes, routing, errors, limits, restarts) independently of
the model. End-to-end tests with the real engine are in test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import sys
import time

import httpx
import numpy as np
import pytest
import websockets

from tests.fakes.harness import RunningServer, fake_settings, recv_event, recv_until, send, start_answer, user_text

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SLOW_ENGINE = ["env", "FAKE_ENGINE_CHUNKS=400", "FAKE_ENGINE_STEP_S=0.03", sys.executable, "-m",
               "tests.fakes.fake_engine", "--model", "x", "--codec", "x", "--device", "cpu"]


@pytest.fixture(scope="module")
def srv():
    settings = fake_settings(api_keys=[KEY], allowed_origins=["http://good.example"], max_sessions=3,
                             max_message_bytes=64 * 1024, max_input_buffer_seconds=5.0)
    with RunningServer(settings) as s:
        yield s


@pytest.fixture(scope="module")
def slow_srv():
    """An engine whose answers last 12 s, for cancel / disconnect / kill mid-answer."""
    with RunningServer(fake_settings(engine_command=SLOW_ENGINE)) as s:
        yield s


def connect(url: str, **kw):
    kw.setdefault("additional_headers", AUTH)
    return websockets.connect(url, max_size=None, **kw)


async def open_session(ws, turn_detection=None):
    created = await recv_event(ws)
    assert created["type"] == "session.created"
    await send(ws, "session.update",
               session={"type": "realtime", "audio": {"input": {"turn_detection": turn_detection}}})
    updated = await recv_event(ws)
    assert updated["type"] == "session.updated", updated
    return updated["session"]


def tone_b64(seconds: float, rate: int = 24000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    return base64.b64encode((0.2 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()).decode()


async def text_turn(ws, text: str, modality: str = "text") -> list[dict]:
    await user_text(ws, text)
    await send(ws, "response.create", response={"output_modalities": [modality]})
    return await recv_until(ws, "response.done")


def by_type(events: list[dict], etype: str) -> list[dict]:
    return [e for e in events if e["type"] == etype]


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
        assert resp["usage"]["prefilled_rows"] == 3 + 4
        assert resp["usage"]["input_token_details"]["cached_tokens"] == 0
        history = resp["usage"]["total_tokens"]

        second = await text_turn(ws, "and again")
        usage = second[-1]["response"]["usage"]
        assert usage["prefilled_rows"] == 2 + 4  # only the new item
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
        assert len(audio) // 2 == resp["usage"]["audio_samples"] > 0
        # Fake engine: 16000 samples -> 12 full codes + a partial one closed by the commit, + 4 commit rows.
        assert resp["usage"]["prefilled_rows"] == 12 + 1 + 4
        assert resp["ttfa_ms"] is not None and resp["ttfa_ms"] > 0
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
        "type": "push_to_talk"}}}}}), "unsupported_turn_detection", "session.audio.input.turn_detection.type"),
    (json.dumps({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f"}]}}),
     "unsupported_parameter", "session.tools"),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active", None),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": ""}]}}), "invalid_audio", "item.content[0].audio"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "function_call"}}),
     "unsupported_item_type", "item.type"),
    # A lone surrogate is valid JSON syntax but no UTF-8 text: it used to reach the engine message and fail there.
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_text", "text": "hi \\ud800"}]}}', "invalid_json", None),
    ('{"type": "session.update", "session": {"instructions": "\\udfff"}}', "invalid_json", None),
    ('{"type": "session.update", "session": {"type": "realtime", "max_output_tokens": NaN}}', "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
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
    from server.session.client_events import ProtocolError, decode_client_event

    pair = decode_client_event('{"type": "x", "text": "\\ud83d\\ude00 caf\\u00e9"}')  # escaped as json.dumps does
    assert pair["text"] == "\U0001f600 caf\u00e9"
    assert decode_client_event(b'{"type": "x"}') == {"type": "x"}  # a binary data channel message
    for bad in ('{"type": "x", "t": "\\ud83d"}', '{"\\udc00": 1}', '{"type": "x", "l": ["\\ude00a"]}',
                b'{"type": "x", "t": "\\ud800"}', '{"v": Infinity}', b'\xff\xfe'):
        with pytest.raises(ProtocolError) as e:
            decode_client_event(bad)
        assert e.value.code == "invalid_json", bad


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


async def test_oversized_message_closes_1009_and_others_keep_working(srv):
    async with connect(srv.ws) as other:
        await open_session(other)
        async with connect(srv.ws) as ws:
            await open_session(ws)
            await send(ws, "input_audio_buffer.append", audio=tone_b64(2.0))  # ~128 KB > 64 KiB
            with pytest.raises(websockets.ConnectionClosed) as e:
                while True:
                    await recv_event(ws)
            assert e.value.rcvd.code == 1009
        evs = await text_turn(other, "are you fine")
        assert evs[-1]["response"]["status"] == "completed"


async def test_auth_and_origin_refused_at_handshake(srv):
    for headers, status in [({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                            ({**AUTH, "Origin": "http://evil.example"}, 403)]:
        with pytest.raises(websockets.InvalidStatus) as e:
            async with websockets.connect(srv.ws, additional_headers=headers):
                pass
        assert e.value.response.status_code == status
    # Browsers put the key in a subprotocol; the server answers with "realtime".
    async with websockets.connect(srv.ws, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"],
                                  additional_headers={"Origin": "http://good.example"}) as ws:
        assert ws.subprotocol == "realtime"
        assert (await recv_event(ws))["type"] == "session.created"


async def test_too_many_sessions_server_busy_then_recovers(srv):
    async with connect(srv.ws) as a, connect(srv.ws) as b, connect(srv.ws) as c:
        for ws in (a, b, c):
            assert (await recv_event(ws))["type"] == "session.created"
        async with connect(srv.ws) as d:
            err = await recv_event(d)
            assert err["type"] == "error" and err["error"]["code"] == "server_busy"
            with pytest.raises(websockets.ConnectionClosed) as e:
                await recv_event(d)
            assert e.value.rcvd.code == 1013
        assert (await text_turn(a, "one more"))[-1]["response"]["status"] == "completed"
    deadline = time.monotonic() + 60  # (a bound on a hang: the closed sockets' sessions end)
    while srv.health().json()["sessions"]:
        assert time.monotonic() < deadline, srv.health().json()
        await asyncio.sleep(0.05)
    async with connect(srv.ws) as ws:
        assert (await recv_event(ws))["type"] == "session.created"


async def wait_running(s: RunningServer, n: int, timeout: float = 60.0) -> None:
    """Until the engine's stats say `n` requests run (they come from the last Pong, every 0.2 s here); the timeout
    only bounds a hang."""
    deadline = time.monotonic() + timeout
    while s.engine_stats()["running"] != n:
        assert time.monotonic() < deadline, s.engine_stats()
        await asyncio.sleep(0.05)


async def test_cancel_mid_answer(slow_srv):
    async with connect(slow_srv.ws) as ws:
        await open_session(ws)
        await start_answer(ws, "talk")
        await wait_running(slow_srv, 1)
        await send(ws, "response.cancel")
        evs = await recv_until(ws, "response.done", timeout=60)
        resp = evs[-1]["response"]
        assert resp["status"] == "cancelled" and resp["status_details"]["reason"] == "client_cancelled"
        assert resp["usage"]["audio_samples"] < 400 * 9600
        await wait_running(slow_srv, 0)
    st = await slow_srv.wait_engine_idle()
    assert st["sessions"] == 0 and st["kv_free"] == st["kv_total"]


async def test_disconnect_mid_answer_aborts_engine_request(slow_srv):
    async with connect(slow_srv.ws) as ws:
        await open_session(ws)
        await start_answer(ws, "talk")
        await wait_running(slow_srv, 1)
    st = await slow_srv.wait_engine_idle()
    assert st["running"] == 0 and st["sessions"] == 0 and st["kv_free"] == st["kv_total"]


async def test_engine_killed_clients_get_error_and_restart_works(slow_srv):
    async with connect(slow_srv.ws) as ws, connect(slow_srv.ws) as idle:
        await open_session(ws)
        await open_session(idle)
        await start_answer(ws, "talk")
        os.kill(slow_srv.app.state.engine.proc.pid, signal.SIGKILL)
        for client, active in ((ws, True), (idle, False)):
            evs = []
            with pytest.raises(websockets.ConnectionClosed) as e:
                while True:
                    evs.append(await recv_event(client, timeout=15))
            assert e.value.rcvd.code == 1011
            errors = [x for x in evs if x["type"] == "error"]
            assert errors and errors[-1]["error"]["code"] == "engine_unavailable"
            if active:
                done = by_type(evs, "response.done")[0]["response"]
                assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "engine_unavailable"
    health = slow_srv.wait_engine(ready=True)
    assert health["engine_restarts"] >= 1
    async with connect(slow_srv.ws) as ws:
        await open_session(ws)
        await user_text(ws, "hi")
        await send(ws, "response.create", response={"max_output_tokens": 10})
        evs = await recv_until(ws, "response.done")
        assert evs[-1]["response"]["status"] == "incomplete"
        assert evs[-1]["response"]["status_details"]["reason"] == "max_output_tokens"
        assert by_type(evs, "response.output_audio.delta")


def test_vad_model_is_loaded_before_the_first_session():
    """Loaded at the first server_vad session instead, the torch import stalled every session for seconds."""
    with RunningServer(fake_settings()) as s:
        assert s.app.state.vad_streams.loaded and not s.app.state.sessions.sessions
    with RunningServer(fake_settings(vad=False)) as s:
        assert s.app.state.vad_streams is None


async def test_health_and_metrics(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await text_turn(ws, "metrics please", modality="audio")
        await ws.send("{")
        await recv_event(ws)
    h = srv.health()
    assert h.status_code == 200 and h.json()["engine_alive"] and h.json()["random_weights"]
    text = httpx.get(srv.http + "/metrics", timeout=10).text
    assert "moss_ttfa_seconds_count" in text
    count = [ln for ln in text.splitlines() if ln.startswith("moss_ttfa_seconds_count")][0]
    assert float(count.split()[-1]) >= 1
    assert 'moss_errors_total{code="invalid_json"}' in text
    assert "moss_kv_blocks_free 4096.0" in text or "moss_kv_blocks_free" in text
    assert "moss_active_sessions" in text and "moss_engine_up 1.0" in text
    assert "moss_audio_underruns_total 0.0" in text  # the fake engine's answers run ahead of real time


def test_client_that_does_not_read_is_closed_as_slow_consumer():
    """A raw sans-I/O client that stops reading (asyncio clients keep reading into memory on their own)."""
    from websockets.client import ClientProtocol
    from websockets.frames import Opcode
    from websockets.uri import parse_uri

    engine = ["env", "FAKE_ENGINE_CHUNKS=3000", "FAKE_ENGINE_STEP_S=0.002", *SLOW_ENGINE[3:]]
    with RunningServer(fake_settings(engine_command=engine, output_queue_size=16)) as s:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # back up the server's socket quickly
        sock.connect(("127.0.0.1", s.port))
        sock.settimeout(10)
        p = ClientProtocol(parse_uri(s.ws), max_size=None)
        p.send_request(p.connect())
        sock.sendall(b"".join(p.data_to_send()))
        while p.handshake_exc is None and p.state.name != "OPEN":
            p.receive_data(sock.recv(65536))
        assert p.handshake_exc is None
        for ev in ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "x"}]}}, {"type": "response.create", "response": {
                    "max_output_tokens": 100000}}):
            p.send_text(json.dumps(ev).encode())
        sock.sendall(b"".join(p.data_to_send()))
        deadline = time.monotonic() + 30
        while not s.app.state.sessions.sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        while s.app.state.sessions.sessions and time.monotonic() < deadline:
            time.sleep(0.05)  # not reading
        assert not s.app.state.sessions.sessions, "the session was not closed"
        texts, close = [], None
        while close is None:
            data = sock.recv(1 << 20)
            if not data:
                break
            p.receive_data(data)
            for f in p.events_received():
                if getattr(f, "opcode", None) == Opcode.TEXT:
                    texts.append(json.loads(f.data))
                elif getattr(f, "opcode", None) == Opcode.CLOSE:
                    close = p.close_rcvd
        sock.close()
        assert close is not None and close.code == 1008
        assert texts[-1]["type"] == "error" and texts[-1]["error"]["code"] == "slow_consumer"


async def test_sigterm_drains_answers_then_closes():
    with RunningServer(fake_settings(drain_timeout_s=10.0)) as s:
        async with connect(s.ws) as ws:
            await open_session(ws)
            await user_text(ws, "x")
            await send(ws, "response.create")
            await recv_until(ws, "response.created")
            s.server.handle_exit(signal.SIGTERM, None)
            evs = []
            with pytest.raises(websockets.ConnectionClosed) as e:
                while True:
                    evs.append(await recv_event(ws))
            assert e.value.rcvd.code == 1001
            assert by_type(evs, "response.done")[0]["response"]["status"] == "completed"
            assert evs[-1]["type"] == "error" and evs[-1]["error"]["code"] == "server_shutting_down"


async def test_drain_returns_once_client_sockets_closed_or_their_grace_ran_out(monkeypatch):
    """uvicorn closes every socket still open with 1012 as soon as the drain returns, so the drain waits for
    the routes to send their last events and close frames (bounded: a stuck socket cannot hold the exit)."""
    from server.session import manager as session_manager
    from server.session.session import SessionLimits

    manager = session_manager.SessionManager(None, max_sessions=2, limits=SessionLimits(), model="m")
    released = asyncio.Event()

    async def socket_route() -> None:
        async with manager.transport():
            await released.wait()

    monkeypatch.setattr(session_manager, "CLOSE_GRACE_S", 3600.0)  # only the sockets closing can end this drain
    routes = [asyncio.create_task(socket_route()) for _ in range(2)]
    await asyncio.sleep(0)
    drain = asyncio.create_task(manager.drain(0.0))
    await asyncio.sleep(0)  # (the drain runs up to its wait for the sockets)
    assert manager.draining and not drain.done()
    released.set()
    await asyncio.wait_for(drain, 60)  # (a bound on a hang)
    await asyncio.gather(*routes)

    monkeypatch.setattr(session_manager, "CLOSE_GRACE_S", 0.2)
    stuck = asyncio.create_task(socket_route())
    released.clear()
    await asyncio.sleep(0)
    await asyncio.wait_for(manager.drain(0.0), 60)  # returns once the grace has run out
    assert not stuck.done()
    released.set()
    await stuck


async def test_two_servers_share_one_engine(tmp_path):
    import subprocess

    endpoint = f"ipc://{tmp_path}/engine.sock"
    engine = subprocess.Popen([*SLOW_ENGINE[3:], "--endpoint", endpoint],
                              env={**os.environ, "FAKE_ENGINE_CHUNKS": "6"})
    try:
        settings = fake_settings(spawn_engine=False, engine_endpoint=endpoint)
        with RunningServer(settings) as a, RunningServer(settings) as b:
            async with connect(a.ws) as wa, connect(b.ws) as wb:
                await open_session(wa)
                await open_session(wb)
                ra, rb = await asyncio.gather(text_turn(wa, "one two"), text_turn(wb, "one two three four"))
            # Each answer went to the server that asked, with its own history (words + 4 rows).
            assert ra[-1]["response"]["usage"]["prefilled_rows"] == 2 + 4
            assert rb[-1]["response"]["usage"]["prefilled_rows"] == 4 + 4
    finally:
        engine.terminate()
        engine.wait(10)


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
        assert done["usage"]["prefilled_rows"] == 12 + 1 + 4  # same rows as 1 s appended and committed
