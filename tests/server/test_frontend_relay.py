"""Ray's front end replicas relaying a WebRTC call's requests to the one holding the call, without Ray: the owner
found by the tag in the call id, the relay port serving call requests alone, and two front end apps in this process
(each with its relay port on 127.0.0.1, one directory called in place as through a deployment handle, one fake
engine) where a call answered by one is reached through the other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import websockets
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from server.cluster import directory as directory_module
from server.cluster.directory import EXPIRE_S, EngineDirectory, FrontendEntry
from server.cluster.peers import FrontendPeers, relayed_only
from server.transports.relay import Owner
from tests.fakes.harness import FAKE_ENGINE, RunningServer, fake_settings, free_port, recv_until, send, user_text
from tests.paths import REPO
from tests.server.transports.webrtc_client import Client

KEY = "sk-test_key.1"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Handle:
    """A deployment handle's `handle.method.remote(*args)`, on an object in this process; `down`: as while the
    deployment has no replica."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.down = False

    def __getattr__(self, name: str) -> SimpleNamespace:
        method = getattr(self.target, name)

        async def remote(*args: Any) -> Any:
            if self.down:
                raise RuntimeError("no replica of the directory")
            return method(*args)

        return SimpleNamespace(remote=remote)


def listed(directory: EngineDirectory, peers: FrontendPeers, host: str, port: int) -> None:
    directory.frontend_heartbeat(asdict(FrontendEntry(tag=peers.tag, host=host, port=port, replica="r")))


async def test_the_owner_is_the_front_end_whose_tag_the_call_id_carries():
    directory = EngineDirectory()
    handle = Handle(directory)
    a, b = FrontendPeers(handle, "127.0.0.1", "a"), FrontendPeers(handle, "127.0.0.1", "b")
    assert a.tag != b.tag and a.call_id_prefix == f"rtc_r{a.tag}_"
    listed(directory, a, "10.0.0.5", 41000)
    call = a.call_id_prefix + "0123456789abcdef"
    assert await b.owner(call) == Owner(f"front end {a.tag}", host="10.0.0.5", port=41000)
    assert await a.owner(call) is None  # its own: answered or 404 where it is
    for other in ("rtc_w0_ff", "rtc_0123abcd", f"rtc_r{a.tag}_", f"{call}\n", f"rtc_r{a.tag}0_ff", "x"):
        assert await b.owner(other) is None, other
    assert await b.owner("rtc_r0badc0de_ff") is None  # no such front end listed
    handle.down = True
    assert await b.owner(call) is None  # the directory restarting: unknown for now
    handle.down = False
    directory.frontend_leave(a.tag)
    assert await b.owner(call) is None


def test_front_end_entries_expire_unless_renewed(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(directory_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    directory = EngineDirectory()
    a = FrontendPeers(None, "127.0.0.1", "a")
    listed(directory, a, "10.0.0.5", 41000)
    now[0] += EXPIRE_S
    assert directory.frontend(a.tag) == {"tag": a.tag, "host": "10.0.0.5", "port": 41000, "replica": "r"}
    now[0] += 0.5
    assert directory.frontend(a.tag) is None and directory.frontends() == []


def test_an_owner_is_a_unix_socket_or_a_tcp_address():
    assert Owner("w", uds="/tmp/w.sock").authority == "worker"
    assert Owner("f", host="10.0.0.5", port=41000).authority == "10.0.0.5:41000"
    assert Owner("f", host="fd00::5", port=41000).authority == "[fd00::5]:41000"
    for bad in ({}, {"uds": "/tmp/w.sock", "host": "10.0.0.5", "port": 1}, {"host": "10.0.0.5"}):
        with pytest.raises(ValueError, match="unix socket or by a host and port"):
            Owner("x", **bad)


def test_the_relay_port_serves_call_requests_alone():
    async def app(scope, receive, send):
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 1000})
            return
        await PlainTextResponse("served")(scope, receive, send)

    client = TestClient(relayed_only(app))  # no lifespan: the app runs its own where Ray serves it
    for path in ("/v1/realtime/calls/rtc_r1_ff", "/v1/realtime/calls/rtc_r1_ff/hangup",
                 "/v1/realtime/calls/rtc_r1_ff/voice"):
        assert client.post(path).text == "served", path
    assert client.get("/v1/realtime/calls/rtc_r1_ff").text == "served"
    for path in ("/health", "/metrics", "/v1/info", "/", "/v1/realtime/calls", "/v1/realtime/calls/x/y"):
        assert client.post(path).status_code == 404, path
        assert client.get(path).status_code == 404, path
    with client.websocket_connect("/v1/realtime?call_id=rtc_r1_ff"):
        pass
    for path in ("/v1/realtime", "/v1/realtime?model=x", "/v1/realtime/calls/rtc_r1_ff?call_id=x"):
        with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect(path):
            pass
        assert refused.value.code == 1008, path


# ---- two front end apps in this process ------------------------------------------------------------------


@contextlib.contextmanager
def _two_frontends(tmp_path: Path):
    endpoint = f"ipc://{tmp_path}/engine.sock"
    engine = subprocess.Popen([*FAKE_ENGINE, "--endpoint", endpoint], cwd=REPO, env=dict(os.environ))
    settings = fake_settings(spawn_engine=False, engine_endpoint=endpoint, vad=False, api_keys=[KEY])
    directory = EngineDirectory()
    servers = []
    try:
        for name in ("a", "b"):
            peers = FrontendPeers(Handle(directory), "127.0.0.1", name)
            servers.append((RunningServer(settings, peers=peers).__enter__(), peers))
        for s, _ in servers:
            s.wait_engine()
        yield servers, directory
    finally:
        for s, _ in servers:
            s.__exit__(None, None, None)
        engine.terminate()
        engine.wait(10)


@pytest.mark.timeout(120)
async def test_a_call_answered_by_one_front_end_is_reached_through_the_other(tmp_path):
    with _two_frontends(tmp_path) as (((a, pa), (b, pb)), directory):
        assert {e["tag"]: e["port"] for e in directory.frontends()} == {pa.tag: pa.port, pb.tag: pb.port}
        async with httpx.AsyncClient(timeout=10, headers=AUTH) as http:
            client = Client(a.http, mic=None)
            await client.connect(http)
            try:
                assert client.call_id.startswith(pa.call_id_prefix)
                await client.wait_event("session.created", 10)
                relay_port = f"http://127.0.0.1:{pa.port}"
                assert (await http.get(f"{relay_port}/health")).status_code == 404  # call requests alone
                state = await http.get(f"{b.http}/v1/realtime/calls/{client.call_id}")
                assert state.status_code == 200 and state.json()["id"] == client.call_id
                # The owner checks the key again: a request sent to its relay port without one is refused there.
                async with httpx.AsyncClient(timeout=10) as keyless:
                    bare = await keyless.get(f"{relay_port}/v1/realtime/calls/{client.call_id}")
                assert bare.status_code == 401
                control = f"{b.ws}?call_id={client.call_id}"
                with pytest.raises(websockets.InvalidStatus) as bad:
                    async with websockets.connect(control, additional_headers={"Authorization": "Bearer wrong"}):
                        pass
                assert bad.value.response.status_code == 401
                async with websockets.connect(control, additional_headers={
                        "Sec-WebSocket-Protocol": f"openai-insecure-api-key.{KEY}"}) as ws:
                    await send(ws, "session.update", session={"audio": {"input": {"turn_detection": None}}})
                    await recv_until(ws, "session.updated", 10)
                    await client.wait_event("session.updated", 5)  # the call's own data channel sees the same
                    await user_text(ws, "hi there")
                    await send(ws, "response.create")
                    events = await recv_until(ws, "response.done", 20)
                    assert events[-1]["response"]["status"] == "completed"
                    r = await http.post(f"{b.http}/v1/realtime/calls/{client.call_id}/hangup")
                    assert r.status_code == 204 and len(a.app.state.calls) == 0
                    with pytest.raises(websockets.ConnectionClosed):  # the call ended: its owner closed the socket
                        while True:
                            await asyncio.wait_for(ws.recv(), 10)
                gone = await http.get(f"{b.http}/v1/realtime/calls/{client.call_id}")
                assert gone.status_code == 404 and gone.json()["error"]["code"] == "call_not_found"
            finally:
                await client.close()
            # A front end that died is listed until its entry expires, and nothing listens where it was.
            ghost = FrontendPeers(None, "127.0.0.1", "ghost")
            listed(directory, ghost, "127.0.0.1", free_port())
            lost = ghost.call_id_prefix + "0123456789abcdef"
            r = await http.get(f"{b.http}/v1/realtime/calls/{lost}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "call_not_found"
            with pytest.raises(websockets.InvalidStatus) as bad:
                async with websockets.connect(f"{b.ws}?call_id={lost}", additional_headers=AUTH):
                    pass
            assert bad.value.response.status_code == 404
            directory.frontend_leave(ghost.tag)
            client = Client(a.http, mic=None)
            await client.connect(http)
            try:
                # Front end a stops: its calls end with it, and it leaves the directory.
                await asyncio.to_thread(a.__exit__, None, None, None)
                assert [e["tag"] for e in directory.frontends()] == [pb.tag]
                gone = await http.get(f"{b.http}/v1/realtime/calls/{client.call_id}")
                assert gone.status_code == 404 and gone.json()["error"]["code"] == "call_not_found"
            finally:
                await client.close()
