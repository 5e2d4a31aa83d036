"""A session's conversation inputs reach the engine in order, and never more than SYNC_EVERY of them are in flight:
the replies the engine may still owe for them (an `error` per refused item) must fit in the outbound stream."""

from __future__ import annotations

import asyncio
import json

from engines.protocol import messages as m
from server.session.engine_link import SYNC_EVERY
from tests.server.session.session_support import Link, new_session


class SlowLink(Link):
    """The engine answers a Sync only when the test says so."""

    async def send(self, msg) -> None:
        self.sent.append(msg)


def user_text(i: int) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"line {i}"}]}}


async def handle_all(s, n: int) -> None:
    for i in range(n):
        await s.handle_client_text(json.dumps(user_text(i)))


async def test_past_sync_every_inputs_the_session_waits_for_the_engine_to_catch_up():
    s, slow = await new_session(link=SlowLink())
    client = asyncio.ensure_future(handle_all(s, SYNC_EVERY + 10))
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(slow.of(m.AddUserText)) == SYNC_EVERY  # the rest waits, and so does the client's next event
    syncs = slow.of(m.Sync)
    assert len(syncs) == 1 and not client.done()
    s.on_engine_message(m.Synced(s.id, syncs[0].seq - 1))  # a stale answer releases nothing
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(slow.of(m.AddUserText)) == SYNC_EVERY
    s.on_engine_message(m.Synced(s.id, syncs[0].seq))
    await asyncio.wait_for(client, 10)
    assert [x.text for x in slow.of(m.AddUserText)] == [f"line {i}" for i in range(SYNC_EVERY + 10)]
    inputs = [x for x in slow.sent if isinstance(x, m.AddUserText | m.Sync)]
    assert inputs.index(syncs[0]) == SYNC_EVERY  # in order: after the inputs it vouches for
    await s.close()


async def test_a_session_that_ends_while_waiting_for_the_engine_stops_waiting():
    s, slow = await new_session(link=SlowLink())
    client = asyncio.ensure_future(handle_all(s, SYNC_EVERY + 1))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not client.done() and len(slow.of(m.Sync)) == 1
    await s.close()
    await asyncio.wait_for(client, 10)


async def test_an_engine_that_answers_each_sync_sees_every_input_in_order():
    s, link = await new_session()
    await handle_all(s, 3 * SYNC_EVERY)
    texts = [x.text for x in link.of(m.AddUserText)]
    assert texts == [f"line {i}" for i in range(3 * SYNC_EVERY)]
    assert len(link.syncs) == 3
    await s.close()


async def test_inputs_from_two_tasks_while_a_sync_is_out_both_go_on_once_the_engine_answers():
    # (the turn detector's audio and, say, an automatic answer's CreateResponse, each from its own task)
    s, slow = await new_session(link=SlowLink())
    first = asyncio.ensure_future(handle_all(s, SYNC_EVERY))  # its last input sends a Sync and waits
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(slow.of(m.Sync)) == 1 and not first.done()
    second = asyncio.ensure_future(s.engine_inputs.send(m.AddUserText(s.id, "item_x", "meanwhile")))
    for _ in range(20):
        await asyncio.sleep(0)
    for sync in slow.of(m.Sync):  # the engine answers every Sync it gets
        s.on_engine_message(m.Synced(s.id, sync.seq))
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    await s.close()
