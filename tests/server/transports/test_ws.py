"""/v1/realtime under hostile or unlucky clients, each written as the attack: a client that sends nothing, one that
stops reading while an answer streams, one that floods events while reading as fast as it can."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
import websockets
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.uri import parse_uri

from server.transports import connections
from tests.fakes.harness import (
    FAKE_ENGINE,
    RunningServer,
    events_until_closed,
    fake_settings,
    recv_event,
    recv_until,
    send,
    tiny_settings,
    user_text,
)

# Answers of 100 chunks 30 ms apart: 3 s, longer than the idle timeout below.
THREE_SECOND_ANSWERS = ["env", "FAKE_ENGINE_CHUNKS=100", "FAKE_ENGINE_STEP_S=0.03", *FAKE_ENGINE]


async def test_a_session_that_sends_nothing_is_closed_after_the_idle_timeout_but_not_while_answered():
    with RunningServer(fake_settings(engine_command=THREE_SECOND_ANSWERS, idle_timeout_s=1.0, vad=False)) as s:
        async with websockets.connect(s.ws) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await user_text(ws, "a three second answer")
            await send(ws, "response.create")
            # The answer runs three idle timeouts long: it completes, and only then does the idleness count.
            evs = await recv_until(ws, "response.done", 60)
            assert evs[-1]["response"]["status"] == "completed"
            events = await events_until_closed(ws)
            assert ws.close_code == 1001 and ws.close_reason == "idle timeout"
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "session_idle_timeout"
        assert not s.app.state.sessions.sessions


@pytest.fixture(scope="module")
def tiny():
    """The real engine (tiny random model, CPU); a client that takes nothing for a second is slow."""
    with RunningServer(tiny_settings(slow_consumer_timeout_s=1.0, vad=False)) as s:
        yield s


def _raw_client(port: int, url: str) -> tuple[socket.socket, ClientProtocol]:
    """A sans-I/O WebSocket client on a socket with a tiny receive buffer: once it stops reading, the server's
    bytes stop being taken after a few kilobytes (an asyncio client would keep reading into memory on its own)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(30)
    p = ClientProtocol(parse_uri(url), max_size=None)
    p.send_request(p.connect())
    sock.sendall(b"".join(p.data_to_send()))
    while p.handshake_exc is None and p.state.name != "OPEN":
        p.receive_data(sock.recv(65536))
    assert p.handshake_exc is None
    return sock, p


def _read_to_close(sock: socket.socket, p: ClientProtocol) -> tuple[list[dict], int | None]:
    texts: list[dict] = []
    for f in p.events_received():
        if getattr(f, "opcode", None) == Opcode.TEXT:
            texts.append(json.loads(f.data))
    while p.close_rcvd is None:
        data = sock.recv(1 << 20)
        if not data:
            break
        p.receive_data(data)
        texts += [json.loads(f.data) for f in p.events_received() if getattr(f, "opcode", None) == Opcode.TEXT]
    return texts, p.close_rcvd.code if p.close_rcvd is not None else None


async def test_a_client_that_stops_reading_while_an_answer_streams_is_closed_as_slow(tiny, caplog):
    caplog.set_level(logging.INFO, logger="server")
    sock, p = _raw_client(tiny.port, tiny.ws)
    try:
        for event in ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "talk for a long time"}]}},
                {"type": "response.create", "response": {"max_output_tokens": 400}}):
            p.send_text(json.dumps(event).encode())
        sock.sendall(b"".join(p.data_to_send()))
        # Not reading from here on: the server must notice that nothing it writes is taken.
        await _until(lambda: bool(tiny.app.state.sessions.sessions), "the session opened")
        await _until(lambda: not tiny.app.state.sessions.sessions, "the session closed as slow", 120)
        texts, code = _read_to_close(sock, p)
    finally:
        sock.close()
    assert code == 1008
    assert texts[-1]["type"] == "error" and texts[-1]["error"]["code"] == "slow_consumer", texts[-1]
    assert any(t["type"] == "response.output_audio.delta" for t in texts)  # it was closed mid-answer
    # Found by what it took (nothing), long before its outbound queue could fill.
    assert any("slow consumer: the client took none of" in r.getMessage() for r in caplog.records)
    st = await tiny.wait_engine_idle(60)
    assert st["running"] == 0 and st["kv_free"] == st["kv_total"]


@pytest.fixture(scope="module")
def tiny_default_stall():
    """The real engine (tiny random model, CPU) with the served stall timeout (a client that takes nothing for 5 s
    is slow), not the module server's 1 s: a reading client in this process shares the CPU with the server."""
    with RunningServer(tiny_settings(vad=False)) as s:
        yield s


async def test_a_client_that_reads_is_never_slow_however_many_events_it_sends(tiny_default_stall):
    """5,000 refused events and 1,500 history items, sent as fast as the socket takes them while the client reads
    as fast as it can: every one is answered and the session stays open (this client was closed as slow after
    ~1,600 events when the outbound queue's length alone decided)."""
    async with websockets.connect(tiny_default_stall.ws, max_size=None) as ws:
        events: list[dict] = []

        async def read() -> None:
            async for message in ws:
                events.append(json.loads(message))

        reader = asyncio.create_task(read())
        bad = json.dumps({"type": "no.such.event"})
        # Each send yields to the reader: a send that finds room in the socket's buffer does not suspend, and a
        # reader starved by its own client's sending is, to the server, a reader that stopped.
        for _ in range(5000):
            await ws.send(bad)
            await asyncio.sleep(0)
        for i in range(1500):
            await user_text_item(ws, f"history line {i}")
            await asyncio.sleep(0)
        await user_text_item(ws, "the last one", item_id="item_last")
        await _until(lambda: any(e["type"] == "conversation.item.added" and e["item"]["id"] == "item_last"
                                 for e in events), "every event answered", 300)
        assert ws.close_code is None
        reader.cancel()
    codes = [e["error"]["code"] for e in events if e["type"] == "error"]
    # Items past what one answer's prompt may hold are refused by the engine (input_too_large), one error each.
    assert codes[:5000] == ["unknown_event"] * 5000 and set(codes[5000:]) <= {"input_too_large"}
    assert sum(e["type"] == "conversation.item.added" for e in events) == 1501


async def user_text_item(ws, text: str, item_id: str | None = None) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await send(ws, "conversation.item.create", item={**item, **({"id": item_id} if item_id else {})})


async def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        await asyncio.sleep(0.02)


async def test_a_client_that_never_reads_again_is_aborted_after_the_final_grace(monkeypatch):
    """Its last event and close frame cannot reach it: the server drops the connection (and its file descriptor)
    instead of waiting on it for ever."""
    monkeypatch.setattr(connections, "FINAL_GRACE_S", 0.5)
    engine = ["env", "FAKE_ENGINE_CHUNKS=3000", "FAKE_ENGINE_STEP_S=0.002", *FAKE_ENGINE]
    with RunningServer(fake_settings(engine_command=engine, slow_consumer_timeout_s=0.5, vad=False)) as s:
        sock, p = _raw_client(s.port, s.ws)
        try:
            p.send_text(json.dumps({"type": "response.create"}).encode())
            sock.sendall(b"".join(p.data_to_send()))
            await _until(lambda: bool(s.app.state.sessions.sessions), "the session opened")
            await _until(lambda: not s.app.state.sessions.sessions, "the session closed as slow")
            await _until(lambda: not s.server.server_state.connections, "the connection dropped")
        finally:
            sock.close()
