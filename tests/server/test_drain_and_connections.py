"""The server process as an operator sees it: SIGTERM drains, an answer the drain cuts still gets its
`response.done`, and the process exits 0; slow and idle connections, past the open-file limit too, do not stop the
sessions already open."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import websockets

from tests.fakes.harness import (
    FAKE_ENGINE,
    RunningServer,
    events_until_closed,
    fake_settings,
    free_port,
    recv_event,
    recv_until,
    send,
    user_text,
)
from tests.paths import REPO

# Answers of 400 chunks 30 ms apart: 12 s, longer than any drain timeout below.
LONG_ANSWERS = ["env", "FAKE_ENGINE_CHUNKS=400", "FAKE_ENGINE_STEP_S=0.03", *FAKE_ENGINE]


async def test_an_answer_cut_by_the_drain_timeout_gets_response_done_before_the_close():
    with RunningServer(fake_settings(engine_command=LONG_ANSWERS, drain_timeout_s=0.5, vad=False)) as s:
        async with websockets.connect(s.ws) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await user_text(ws, "a long answer")
            await send(ws, "response.create")
            await recv_until(ws, "response.output_audio.delta")
            s.server.handle_exit(signal.SIGTERM, None)
            events = await events_until_closed(ws)
            assert ws.close_code == 1001
        types = [e["type"] for e in events]
        done = events[types.index("response.done")]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "server_shutting_down"
        assert types[-1] == "error" and events[-1]["error"]["code"] == "server_shutting_down"
        assert types.index("response.done") < len(types) - 1


def _serve(tmp_path, port: int, open_files: int | None = None, **env: str) -> subprocess.Popen:
    """`moss-speech serve` with the fake engine; `open_files`: its open-file limit, soft and hard (so that it
    cannot raise it)."""
    env = {**os.environ, "MOSS_ENGINE_COMMAND": json.dumps(FAKE_ENGINE), "MOSS_VAD": "false",
           "MOSS_DRAIN_TIMEOUT_S": "2", **env}

    def limit() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with open(tmp_path / "serve.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moss_speech.cli", "serve", "--port", str(port)], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.timeout(180)
async def test_slow_and_idle_connections_past_the_open_file_limit_do_not_stop_an_established_session(tmp_path):
    """The attack: 400 connections that send nothing or half a request head (slowloris), one that trickles a header
    line every 200 ms, against a server allowed 256 open files. The session that was already open completes a turn
    meanwhile; every slow connection is closed at the head deadline (those the server could not accept yet, once
    it could); and the server then serves new requests."""
    port = free_port()
    proc = _serve(tmp_path, port, open_files=256, MOSS_HEADER_TIMEOUT_S="2")
    slow: list[socket.socket] = []
    try:
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime") as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            for i in range(400):
                sock = socket.create_connection(("127.0.0.1", port))
                if i % 2:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head never finished
                sock.setblocking(False)
                slow.append(sock)
            trickler = socket.create_connection(("127.0.0.1", port))
            trickler.sendall(b"GET /health HTTP/1.1\r\n")
            await user_text(ws, "still there?")
            await send(ws, "response.create")
            done = (await recv_until(ws, "response.done", 60))[-1]
            assert done["response"]["status"] == "completed"
            deadline = time.monotonic() + 60
            trickled = 0
            while True:
                try:
                    trickler.sendall(b"X-Slow: %d\r\n" % trickled)
                    trickled += 1
                except OSError:
                    break
                assert time.monotonic() < deadline, "the trickling connection was never closed"
                await asyncio.sleep(0.2)
            open_left = slow
            while open_left:
                open_left = [s for s in open_left if not _closed_by_server(s)]
                assert time.monotonic() < deadline, f"{len(open_left)} slow connections still open"
                await asyncio.sleep(0.1)
            assert (await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/health", timeout=10)).status_code \
                == 200
            await user_text(ws, "and now?")
            await send(ws, "response.create")
            assert (await recv_until(ws, "response.done", 60))[-1]["response"]["status"] == "completed"
    finally:
        for sock in slow:
            sock.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.mark.timeout(120)
def test_sigterm_exits_zero_after_the_drain(tmp_path):
    proc = _serve(tmp_path, free_port())
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
