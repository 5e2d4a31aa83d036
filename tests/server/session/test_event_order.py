"""A session handles its client events one at a time, in the order they came, even when its transports hand them
over at once (a WebRTC call's data channel spawns a task per message; its control WebSocket and voice upload run
beside it): an event never starts while an earlier one waits half-way (here, for the end-of-turn model to load)."""

from __future__ import annotations

import asyncio
import threading

from engines.protocol import messages as m
from server.session.session import Session
from server.turn_model import EndOfTurnQueue
from server.vad import VadBatcher
from tests.server.session.session_support import Link, drain, settled, types
from tests.server.session.turn_model_fakes import Model


class SlowLoad:
    """An end-of-turn model whose load waits until the test releases it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> Model:
        self.started.set()
        assert self.release.wait(30), "the test never released the load"
        return Model(0.9)


async def _session(load: SlowLoad) -> tuple[Session, Link]:
    link = Link()
    s = Session("sess_test", link, vad_factory=VadBatcher(end_of_turn=EndOfTurnQueue(load=load)).stream)
    await s.start()
    drain(s)
    return s, link


async def _until(flag: threading.Event) -> None:
    while not flag.is_set():
        await asyncio.sleep(0.001)


async def test_an_event_waits_for_the_one_before_it_to_finish():
    load = SlowLoad()
    s, link = await _session(load)
    update = asyncio.create_task(s.handle_client_event({"type": "session.update", "session": {
        "type": "realtime", "instructions": "Answer in French.",
        "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}}))
    await _until(load.started)  # the update now waits for the model's load, in a thread
    create = asyncio.create_task(s.handle_client_event({"type": "response.create"}))
    for _ in range(20):
        await asyncio.sleep(0)
    early = link.of(m.CreateResponse)
    load.release.set()
    assert not early, "the response went to the engine before the session's new instructions"
    await asyncio.gather(update, create)
    await settled(s)
    kinds = [type(x).__name__ for x in link.sent]
    assert kinds.index("UpdateSession") < kinds.index("CreateResponse"), kinds
    assert link.of(m.UpdateSession)[0].instructions == "Answer in French."
    t = types(drain(s))
    assert t.index("session.updated") < t.index("response.created"), t


async def test_events_waiting_behind_a_close_are_dropped():
    load = SlowLoad()
    s, link = await _session(load)
    update = asyncio.create_task(s.handle_client_event({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}}))
    await _until(load.started)
    create = asyncio.create_task(s.handle_client_event({"type": "response.create"}))
    await asyncio.sleep(0)
    await s.close("client_gone")
    load.release.set()
    await asyncio.gather(update, create)
    assert not link.of(m.CreateResponse)
