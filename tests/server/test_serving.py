"""Shutdown as an operator sees it: SIGTERM drains, an answer the drain cuts still gets its `response.done`, and
the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import websockets

from tests.fakes.harness import (
    FAKE_ENGINE,
    RunningServer,
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


async def _events_until_closed(ws) -> list[dict]:
    events = []
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            events.append(await recv_event(ws, 60))
    return events


async def test_an_answer_cut_by_the_drain_timeout_gets_response_done_before_the_close():
    with RunningServer(fake_settings(engine_command=LONG_ANSWERS, drain_timeout_s=0.5, vad=False)) as s:
        async with websockets.connect(s.ws) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await user_text(ws, "a long answer")
            await send(ws, "response.create")
            await recv_until(ws, "response.output_audio.delta")
            s.server.handle_exit(signal.SIGTERM, None)
            events = await _events_until_closed(ws)
            assert ws.close_code == 1001
        types = [e["type"] for e in events]
        done = events[types.index("response.done")]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["reason"] == "server_shutting_down"
        assert types[-1] == "error" and events[-1]["error"]["code"] == "server_shutting_down"
        assert types.index("response.done") < len(types) - 1


@pytest.mark.timeout(120)
def test_sigterm_exits_zero_after_the_drain(tmp_path):
    port = free_port()
    env = {**os.environ, "MOSS_ENGINE_COMMAND": json.dumps(FAKE_ENGINE), "MOSS_VAD": "false",
           "MOSS_DRAIN_TIMEOUT_S": "2"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moss_speech.cli", "serve", "--port", str(port)], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

