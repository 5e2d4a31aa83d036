"""The server around realtime sessions, against a real server with the scripted fake engine: auth and Origin at the
handshake, message and session limits, answers cancelled or abandoned mid-way, engine restarts, slow consumers,
health and metrics, the drain on SIGTERM, two servers on one engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import pytest
import websockets

from tests.fakes.harness import RunningServer, fake_settings, recv_event, recv_until, send, start_answer, user_text
from tests.server.realtime_support import (
    AUTH,
    KEY,
    SLOW_ENGINE,
    by_type,
    connect,
    open_session,
    text_turn,
    tone_b64,
    wait_running,
)


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


async def test_cancel_mid_answer(slow_srv):
    async with connect(slow_srv.ws) as ws:
        await open_session(ws)
        await start_answer(ws, "talk")
        await wait_running(slow_srv, 1)
        await send(ws, "response.cancel")
        evs = await recv_until(ws, "response.done", timeout=60)
        resp = evs[-1]["response"]
        assert resp["status"] == "cancelled" and resp["status_details"]["reason"] == "client_cancelled"
        assert resp["moss"]["audio_samples"] < 400 * 9600
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
        os.kill(slow_srv.engine().proc.pid, signal.SIGKILL)
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
            assert ra[-1]["response"]["moss"]["prefilled_rows"] == 2 + 4
            assert rb[-1]["response"]["moss"]["prefilled_rows"] == 4 + 4
    finally:
        engine.terminate()
        engine.wait(10)
