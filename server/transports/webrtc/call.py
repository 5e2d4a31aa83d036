"""One WebRTC call: an aiortc peer bound to one realtime session, and the registry that owns all calls.

A call moves three things: the user's mic track into the session (16 kHz PCM), the session's answer audio
into the paced outbound track, and the session's JSON events onto the `oai-events` data channel and any
control WebSocket bound to the call. It ends, and frees its peer, on hang-up, on ICE failure or timeout,
when the peer closes, or when the session ends; `CallRegistry.close_all()` runs on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from aiortc import RTCPeerConnection
from aiortc.mediastreams import MediaStreamTrack

from engines.protocol import errors
from server.session.client_json import ProtocolError, decode_client_event
from server.session.pacing import AudioOut
from server.session.server_events import error_event
from server.session.session import Session
from server.session.tasks import Background
from server.transports.webrtc.tracks import OutboundAudioTrack, pump_inbound

log = logging.getLogger(__name__)

EVENT_CHANNEL = "oai-events"
_MAX_PENDING_EVENTS = 256  # events queued before the data channel opens (session.created and friends)
# Client events waiting to be handled: a client past it sends faster than any answer needs, and the call ends (the
# data channel cannot be read more slowly, as a WebSocket is).
MAX_INBOX = 512
# Bytes of events the data channel holds unsent: past it the client has stopped reading them (the peer's SCTP window
# stays full), and the call ends as a slow consumer, as a WebSocket's would.
MAX_CHANNEL_BUFFERED = 4 * 1024 * 1024
_FEED_ERROR_EVERY_S = 5.0


EventSink = Callable[[str], Awaitable[None]]


class Call:
    def __init__(self, call_id: str, pc: RTCPeerConnection, session: Session, *, prebuffer_ms: int,
                 ice_timeout_s: float, on_closed: Callable[[Call], None]) -> None:
        self.call_id = call_id
        self.pc = pc
        self.session = session
        self.created = time.monotonic()
        self.closed = False
        self.close_reason: str | None = None
        self._on_closed = on_closed
        self._ice_timeout_s = ice_timeout_s
        self.track = OutboundAudioTrack(prebuffer_ms=prebuffer_ms, on_started=self._audio_started,
                                        on_stopped=self._audio_stopped, on_played=session.audio_played)
        self._channel = None
        self._pending: deque[str] = deque(maxlen=_MAX_PENDING_EVENTS)
        self._inbox: deque[dict[str, Any]] = deque()  # the client's events, handled one at a time in order
        self._inbox_task: asyncio.Task | None = None
        self._sinks: set[EventSink] = set()  # bound control WebSockets
        self._tasks = Background(f"call-{call_id}", log, lambda name: self.close_soon(f"internal error in {name}"))
        self._closing: asyncio.Task | None = None
        self._last_feed_error = -_FEED_ERROR_EVERY_S
        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)

    # ---- wiring ----------------------------------------------------------------------------

    def start(self) -> None:
        """After the answer is set: forward session output and watch ICE."""
        self._tasks.spawn(self._forward_outbound(), "outbound")
        self._tasks.spawn(self._ice_watchdog(), "ice-watchdog")

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio":
            return
        self._tasks.spawn(pump_inbound(track, self._feed), "inbound")

    async def _feed(self, pcm: Any, rate: int) -> None:
        try:
            await self.session.feed_audio(pcm, rate)
        except ProtocolError as e:
            # e.g. push-to-talk never committed: the mic keeps flowing, so report once in a while and drop audio
            now = time.monotonic()
            if now - self._last_feed_error >= _FEED_ERROR_EVERY_S:
                self._last_feed_error = now
                await self._emit(error_event(e.code, e.message, param=e.param))

    def _on_datachannel(self, channel: Any) -> None:
        if channel.label != EVENT_CHANNEL:
            log.info("call %s: ignoring data channel %r", self.call_id, channel.label)
            return
        self._channel = channel

        @channel.on("message")
        def _on_message(message: str | bytes) -> None:
            self._take(message)

        @channel.on("open")
        def _on_open() -> None:
            self._flush_pending()

        if channel.readyState == "open":
            self._flush_pending()

    def _take(self, message: str | bytes) -> None:
        """A data channel message: handled after the ones before it, by one task."""
        if self.closed or self._closing is not None:
            return
        try:
            event = decode_client_event(message)
        except ProtocolError as e:
            self._emit_nowait(error_event(e.code, f"data channel message refused: {e.message}"))
            return
        if len(self._inbox) >= MAX_INBOX:
            self._emit_nowait(error_event(errors.TOO_MANY_EVENTS, f"more than {MAX_INBOX} events were waiting to be "
                                          "handled: the call ends"))
            self.close_soon("the client sent events faster than they could be handled")
            return
        if event.get("type") == "output_audio_buffer.clear":
            # Stop the answer audio now; the session then cuts the answer where the track left off and says so.
            self._clear_audio()
        self._inbox.append(event)
        if self._inbox_task is None or self._inbox_task.done():
            self._inbox_task = self._tasks.spawn(self._handle_inbox(), "client-events")

    async def _handle_inbox(self) -> None:
        while self._inbox:
            await self.session.handle_client_event(self._inbox.popleft())

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        log.info("call %s: connection %s", self.call_id, state)
        if state in ("failed", "closed"):
            self.close_soon(f"peer connection {state}")

    async def _ice_watchdog(self) -> None:
        await asyncio.sleep(self._ice_timeout_s)
        if self.pc.connectionState != "connected":
            self.close_soon(f"ICE did not connect within {self._ice_timeout_s:g} s")

    # ---- session -> client -----------------------------------------------------------------

    async def _forward_outbound(self) -> None:
        while True:
            item = await self.session.outbound.get()
            if item is None:
                self.close_soon("session ended")
                return
            if isinstance(item, AudioOut):
                self.track.push(item.response_id, item.pcm24k)
                continue
            etype = item.get("type")
            if etype == "response.output_audio.done":
                self.track.end_response(item.get("response_id", ""))
            elif etype == "response.done":
                self.track.end_response((item.get("response") or {}).get("id", ""))
            await self._emit(item)
            if etype == "input_audio_buffer.speech_started":
                # Barge-in: the session cuts the answer at the samples this track reported as played (its
                # conversation.item.truncated follows); what is still buffered here must not be heard. The events go
                # in the order OpenAI's WebRTC server sends them: speech_started, cleared, truncated.
                rid = self._clear_audio()
                if rid is not None:
                    await self._emit({"type": "output_audio_buffer.cleared", "event_id": _event_id(),
                                      "response_id": rid})

    def _clear_audio(self) -> str | None:
        """Drop the answer audio not yet played; returns the response it belonged to (None: nothing was playing)."""
        rid, played = self.track.clear()
        if rid is not None:
            self.session.audio_played(rid, played)
        return rid

    def _audio_started(self, response_id: str) -> None:
        self._emit_nowait({"type": "output_audio_buffer.started", "event_id": _event_id(),
                           "response_id": response_id})

    def _audio_stopped(self, response_id: str) -> None:
        self._emit_nowait({"type": "output_audio_buffer.stopped", "event_id": _event_id(),
                           "response_id": response_id})

    def _emit_nowait(self, event: dict[str, Any]) -> None:
        self._tasks.spawn(self._emit(event), "emit")

    async def _emit(self, event: dict[str, Any]) -> None:
        text = json.dumps(event)
        ch = self._channel
        if ch is not None and ch.readyState == "open":
            if ch.bufferedAmount > MAX_CHANNEL_BUFFERED:
                self.session.consumer_stalled(f"the data channel holds {ch.bufferedAmount} bytes unsent")
                return
            ch.send(text)
        else:
            self._pending.append(text)
        for sink in list(self._sinks):
            try:
                await sink(text)
            except Exception:  # a dead WebSocket unbinds itself; the call goes on
                self._sinks.discard(sink)

    def _flush_pending(self) -> None:
        ch = self._channel
        while self._pending and ch is not None and ch.readyState == "open":
            ch.send(self._pending.popleft())

    # ---- control WebSocket binding ---------------------------------------------------------

    def bind(self, sink: EventSink) -> None:
        """Mirror this call's events to `sink` (a control WebSocket's send_text)."""
        self._sinks.add(sink)

    def unbind(self, sink: EventSink) -> None:
        self._sinks.discard(sink)

    # ---- lifecycle -------------------------------------------------------------------------

    def close_soon(self, reason: str) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.close(reason))

    async def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        log.info("call %s: closing (%s)", self.call_id, reason)
        self._on_closed(self)
        self._tasks.cancel()
        self.track.stop()
        with contextlib.suppress(Exception):
            await self.session.close(f"webrtc call closed: {reason}")
        with contextlib.suppress(Exception):
            await self.pc.close()
        self._sinks.clear()


class CallRegistry:
    """All live calls; enforces the call limit and frees everything on shutdown."""

    def __init__(self, max_calls: int) -> None:
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        self.max_calls = max_calls
        self._calls: dict[str, Call] = {}
        self._reserved = 0  # calls being negotiated (counted against the limit before they exist)

    def __len__(self) -> int:
        return len(self._calls)

    def get(self, call_id: str) -> Call | None:
        return self._calls.get(call_id)

    def try_reserve(self) -> bool:
        if len(self._calls) + self._reserved >= self.max_calls:
            return False
        self._reserved += 1
        return True

    def release(self) -> None:
        self._reserved = max(0, self._reserved - 1)

    def add(self, call: Call) -> None:
        self._calls[call.call_id] = call

    def remove(self, call: Call) -> None:
        if self._calls.get(call.call_id) is call:
            del self._calls[call.call_id]

    async def close_all(self, reason: str = "server shutting down") -> None:
        await asyncio.gather(*(c.close(reason) for c in list(self._calls.values())), return_exceptions=True)


def new_call_id(prefix: str = "rtc_") -> str:
    """`prefix`: the answering process's (server.transports.relay.Siblings), so its siblings can tell who holds
    the call."""
    return prefix + uuid.uuid4().hex[:24]


def _event_id() -> str:
    return "event_" + uuid.uuid4().hex[:20]
