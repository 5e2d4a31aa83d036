"""A call's data channel in-process: its client events go to the session one at a time in the order they came, a
client that floods the channel gets `too_many_events` and loses the call (the channel cannot be read more slowly),
and one that stops reading its events loses it as a slow consumer."""

from __future__ import annotations

import asyncio
import json

from aiortc import RTCPeerConnection

from engines.protocol import errors
from engines.protocol import messages as m
from server.transports.webrtc.call import EVENT_CHANNEL, MAX_CHANNEL_BUFFERED, MAX_INBOX, Call
from tests.server.session.session_support import new_session, settled
from tests.server.transports.webrtc_client import wait_until


class Channel:
    """The `oai-events` data channel as the call sees it: it registers handlers and sends text."""

    label = EVENT_CHANNEL
    readyState = "open"
    bufferedAmount = 0  # bytes sent but not yet taken by the peer

    def __init__(self) -> None:
        self.handlers: dict = {}
        self.sent: list[dict] = []

    def on(self, name: str):
        def register(f):
            self.handlers[name] = f
            return f
        return register

    def send(self, text: str) -> None:
        self.sent.append(json.loads(text))

    def receive(self, event: dict) -> None:
        self.handlers["message"](json.dumps(event))


async def _call():
    s, link = await new_session(audio_out="track")
    call = Call("rtc_test", RTCPeerConnection(), s, prebuffer_ms=60, ice_timeout_s=60, on_closed=lambda c: None)
    channel = Channel()
    call._on_datachannel(channel)
    call.start()
    return call, channel, s, link


def _user_text(text: str) -> dict:
    return {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": text}]}}


async def test_events_reach_the_session_in_the_order_they_came():
    call, channel, s, link = await _call()
    try:
        channel.receive({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief.",
                                                               "audio": {"input": {"turn_detection": None}}}})
        for i in range(5):
            channel.receive(_user_text(f"turn {i}"))
        channel.receive({"type": "response.create"})
        await asyncio.sleep(0)  # nothing has run yet: every event waits its turn
        await wait_until(lambda: not call._inbox and link.of(m.CreateResponse), 10, "the response")
        await settled(s)
        await wait_until(lambda: any(e["type"] == "response.created" for e in channel.sent), 10, "response.created")
        sent = [x for x in link.sent if not isinstance(x, m.OpenSession)]
        assert [type(x).__name__ for x in sent] == ["UpdateSession"] + ["AddUserText"] * 5 + ["CreateResponse"]
        assert [x.text for x in sent[1:6]] == [f"turn {i}" for i in range(5)]
        kinds = [e["type"] for e in channel.sent]
        assert kinds.index("session.updated") < kinds.index("conversation.item.added") < kinds.index(
            "response.created"), kinds
    finally:
        await call.close("test over")


async def test_a_flooded_channel_ends_the_call_with_too_many_events():
    call, channel, s, link = await _call()
    for i in range(MAX_INBOX + 50):  # all at once: the session has handled none of them yet
        channel.receive(_user_text(f"{i}"))
    await wait_until(lambda: call.closed, 10, "the call's end")
    errors = [e["error"] for e in channel.sent if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["too_many_events"], errors
    assert "512" in errors[0]["message"]
    assert s.closed and call.close_reason == "the client sent events faster than they could be handled"
    added = [x.text for x in link.of(m.AddUserText)]
    assert added == [f"{i}" for i in range(len(added))]  # those handled before the end, in order


async def test_malformed_messages_are_refused_in_place_and_the_call_goes_on():
    call, channel, s, link = await _call()
    try:
        channel.handlers["message"]("{not json")
        channel.handlers["message"]("[1]")
        channel.receive(_user_text("after"))
        await wait_until(lambda: link.of(m.AddUserText), 10, "the item")
        codes = [e["error"]["code"] for e in channel.sent if e["type"] == "error"]
        assert codes == ["invalid_json", "invalid_event"], codes
        assert not call.closed
    finally:
        await call.close("test over")


async def test_a_client_that_stops_reading_loses_the_call_as_a_slow_consumer():
    call, channel, s, link = await _call()
    channel.receive(_user_text("read"))
    await wait_until(lambda: any(e["type"] == "conversation.item.added" for e in channel.sent), 10, "the item")
    channel.bufferedAmount = MAX_CHANNEL_BUFFERED + 1  # the peer's window stays full: nothing more leaves
    sent = len(channel.sent)
    channel.receive(_user_text("unread"))
    await wait_until(lambda: call.closed, 10, "the call's end")
    assert s.closed and s.close_code == errors.close_code(errors.SLOW_CONSUMER)
    assert len(channel.sent) == sent  # nothing more was queued on the jammed channel
