"""/v1/realtime under hostile or unlucky clients, each written as the attack: a client that sends nothing, one that
stops reading while an answer streams, one that floods events while reading as fast as it can."""

from __future__ import annotations

import pytest
import websockets

from tests.fakes.harness import FAKE_ENGINE, RunningServer, fake_settings, recv_event, recv_until, send, user_text

# Answers of 100 chunks 30 ms apart: 3 s, longer than the idle timeout below.
THREE_SECOND_ANSWERS = ["env", "FAKE_ENGINE_CHUNKS=100", "FAKE_ENGINE_STEP_S=0.03", *FAKE_ENGINE]


async def _events_until_closed(ws) -> list[dict]:
    events = []
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            events.append(await recv_event(ws, 60))
    return events


async def test_a_session_that_sends_nothing_is_closed_after_the_idle_timeout_but_not_while_answered():
    with RunningServer(fake_settings(engine_command=THREE_SECOND_ANSWERS, idle_timeout_s=1.0, vad=False)) as s:
        async with websockets.connect(s.ws) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await user_text(ws, "a three second answer")
            await send(ws, "response.create")
            # The answer runs three idle timeouts long: it completes, and only then does the idleness count.
            evs = await recv_until(ws, "response.done", 60)
            assert evs[-1]["response"]["status"] == "completed"
            events = await _events_until_closed(ws)
            assert ws.close_code == 1001 and ws.close_reason == "idle timeout"
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "session_idle_timeout"
        assert not s.app.state.sessions.sessions
