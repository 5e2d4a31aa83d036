"""`GET /v1/realtime` WebSocket: the OpenAI Realtime event protocol over JSON text frames.

Handshake refusals (HTTP status instead of an upgrade): bad Origin -> 403, missing or wrong API key
-> 401, unknown `call_id` -> 404. After the upgrade:

  close 1000  normal end (client closed, or session ended)
  close 1001  server shutting down (after an `error` event `server_shutting_down`), or reason "idle timeout" after
              an `error` event `session_idle_timeout` (nothing sent for idle_timeout_s while no answer ran)
  close 1008  client did not read its events (after an `error` event `slow_consumer`): it took none of the bytes
              waiting for it for slow_consumer_timeout_s (server/transports/connections.py measures
              what it takes), or its outbound queue filled

  close 1009  a message larger than max_message_bytes
  close 1011  engine process lost, or an internal error (after an `error` event `engine_unavailable` /
              `server_error`)
  close 1013  too many sessions / engine restarting / shutting down (after an `error` event `server_busy` /
              `engine_unavailable` / `server_shutting_down`)

The codes and their close codes are engines/protocol/errors.py's.

`?model=` is accepted (the openai SDK always sends one) and not used: this server serves one model.
`?call_id=` binds the socket to a WebRTC call's session as its control channel (events both ways, audio
stays on the call's tracks); the call owns that session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.responses import PlainTextResponse

from engines.protocol import errors
from server import auth, client_secrets
from server.session import server_events as ev
from server.session.manager import SessionRefused
from server.transports.connections import SEND_METER, SendMeter

log = logging.getLogger("server.ws")
router = APIRouter()

SEND_TIMEOUT_S = 5.0  # a final event or close frame that cannot be written in this time is abandoned
STALL_CHECKS = 4  # looks at what the client has taken per slow_consumer_timeout_s


async def _deny(ws: WebSocket, status: int, reason: str) -> None:
    try:
        await ws.send_denial_response(PlainTextResponse(reason, status_code=status))
    except RuntimeError:  # server without the denial-response extension
        await ws.close(code=errors.CLOSE_POLICY_VIOLATION, reason=reason)


def _subprotocol(ws: WebSocket) -> str | None:
    offered = auth.offered_subprotocols(ws.headers)
    return "realtime" if "realtime" in offered else None


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    async with ws.app.state.sessions.transport():  # the drain waits for this socket's close frame
        await _serve(ws)


async def _serve(ws: WebSocket) -> None:
    st = ws.app.state
    settings = st.settings
    if not auth.origin_ok(settings.allowed_origins, ws.headers.get("origin")):
        await _deny(ws, errors.http_status(errors.ORIGIN_NOT_ALLOWED), "origin not allowed")
        return
    if not auth.request_authorized(settings.api_keys, st, ws.headers, ws.query_params):
        await _deny(ws, errors.http_status(errors.INVALID_API_KEY),
                    "missing or invalid API key (Authorization: Bearer KEY)")
        return
    call_id = ws.query_params.get("call_id")
    if call_id is not None:
        await _control_socket(ws, call_id)
        return
    await ws.accept(subprotocol=_subprotocol(ws))
    try:
        session = st.sessions.create(audio_out="events")
    except SessionRefused as e:
        st.metrics.error(e.code)
        await _send_and_close(ws, ev.error_event(e.code, e.message), errors.CLOSE_TRY_AGAIN_LATER)
        return
    try:
        await session.start()
    except Exception as e:  # noqa: BLE001 - e.g. the engine went away or VAD failed to load
        session.log.exception("session start failed")
        await session.close("start_failed", errors.close_code(errors.SERVER_ERROR))
        await _send_and_close(ws, ev.error_event(errors.SERVER_ERROR, f"session could not start: {type(e).__name__}"),
                              errors.close_code(errors.SERVER_ERROR))
        return
    carried = client_secrets.session_settings(settings.api_keys, auth.presented_key(ws.headers, ws.query_params))
    if carried is not None:  # the settings its client secret was issued with: its first session.update
        await session.handle_client_event({"type": "session.update", "session": carried})
    meter = ws.scope.get("extensions", {}).get(SEND_METER)
    await _pump(ws, session, settings.max_message_bytes, meter, settings.slow_consumer_timeout_s)


async def _send_and_close(ws: WebSocket, event: dict[str, Any], code: int) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.send_text(json.dumps(event)), SEND_TIMEOUT_S)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code=code), SEND_TIMEOUT_S)


class _Reader:
    """Client messages until `ended` completes: that interrupts the wait for the next message, never a
    handler half-way. (Not a task and a wait per message: ~10 us each, at 50 messages per second per
    session a tenth of a core at 256 sessions.) With `outbound`, the next message waits until that queue has room:
    a client's events are answered by events, so it cannot pile them up faster than it reads them."""

    def __init__(self, ws: WebSocket, ended: asyncio.Future[Any], outbound: Any = None) -> None:
        self.ws = ws
        self.ended = ended
        self.outbound = outbound
        self._me = asyncio.current_task()
        self._waiting = False
        ended.add_done_callback(self._interrupt)

    def _interrupt(self, _: asyncio.Future[Any]) -> None:
        if self._waiting and self._me is not None:
            self._me.cancel()

    async def receive(self) -> dict[str, Any] | None:
        """The next ASGI message; None once `ended` has completed."""
        if self.ended.done():
            return None
        self._waiting = True
        try:
            if self.outbound is not None:
                await self.outbound.room()
            return await self.ws.receive()
        except asyncio.CancelledError:
            if self._me is None or not self.ended.done() or self._me.uncancel() > 0:  # cancelled from outside too
                raise
            return None
        finally:
            self._waiting = False


async def _pump(ws: WebSocket, session: Any, max_bytes: int, meter: SendMeter | None = None,
                stall_timeout_s: float = 5.0) -> None:
    writer = asyncio.create_task(_writer(ws, session), name=f"ws-writer-{session.id}")
    watch = asyncio.create_task(_watch_taken(meter, session, stall_timeout_s), name=f"ws-watch-{session.id}") \
        if meter is not None else None
    close_code: int | None = None
    # The writer ends when the session closed elsewhere (engine lost, drain) and what was queued is sent; a writer
    # blocked on a client that stopped reading does not, so the session's close ends the reading too.
    closed = asyncio.ensure_future(session.wait_closed())
    ended = asyncio.ensure_future(asyncio.wait({writer, closed}, return_when=asyncio.FIRST_COMPLETED))
    reader = _Reader(ws, ended, session.outbound)
    try:
        while not session.closed:
            msg = await reader.receive()
            if msg is None:
                break
            if msg["type"] == "websocket.disconnect":
                await session.close("client_disconnected")
                return
            text = msg.get("text")
            data = msg.get("bytes")
            size = len(text.encode()) if text is not None else len(data or b"")
            if size > max_bytes:
                session.log.info("message of %d bytes over the limit of %d: closing 1009", size, max_bytes)
                close_code = errors.CLOSE_MESSAGE_TOO_BIG
                await session.close("message_too_big", close_code)
                break
            if text is None:
                session.error(errors.INVALID_EVENT, "binary frames are not supported; send JSON text events")
                continue
            await session.handle_client_text(text)
    except WebSocketDisconnect:
        await session.close("client_disconnected")
        return
    finally:
        if not session.closed:
            await session.close("transport_ended")
        for task in (watch, ended, closed):
            if task is not None:
                task.cancel()
    if session.closed_as_slow and meter is not None:
        # What is queued would wait behind what the client has not read: it gets the reason and the close now.
        writer.cancel()
        meter.send_final(json.dumps(session.slow_consumer_error()), errors.close_code(errors.SLOW_CONSUMER))
        return
    # Let the writer send what is queued (e.g. the error explaining the close), then close the socket.
    with contextlib.suppress(asyncio.TimeoutError, Exception):
        await asyncio.wait_for(asyncio.shield(writer), SEND_TIMEOUT_S)
    writer.cancel()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code=close_code or session.close_code, reason=session.close_reason),
                               SEND_TIMEOUT_S)


async def _writer(ws: WebSocket, session: Any) -> None:
    while True:
        item = await session.outbound.get()
        if item is None:
            return
        try:
            await ws.send_text(json.dumps(item))
        except Exception:  # noqa: BLE001 - the peer went away; the reader sees the disconnect
            return


async def _watch_taken(meter: SendMeter, session: Any, timeout_s: float) -> None:
    """Close the session as a slow consumer once its client has taken none of the bytes waiting for it for
    `timeout_s`. A client that reads keeps taking (at least at the pace it plays audio), however much it is sent;
    one that stopped reading takes nothing once its own socket buffer is full."""
    loop = asyncio.get_running_loop()
    taken = meter.taken()
    progress_at = loop.time()
    while not session.closed:
        await asyncio.sleep(timeout_s / STALL_CHECKS)
        now, waiting, was = loop.time(), meter.waiting(), taken
        taken = meter.taken()
        if waiting == 0 or taken > was:
            progress_at = now
        elif now - progress_at >= timeout_s:
            session.consumer_stalled(f"the client took none of {waiting} bytes in {now - progress_at:.1f} s")
            return


async def _control_socket(ws: WebSocket, call_id: str) -> None:
    calls = getattr(ws.app.state, "calls", None)
    call = calls.get(call_id) if calls is not None else None
    if call is None:
        relay = getattr(ws.app.state, "relay", None)  # the call may be a sibling process's
        owner = await relay.owner(call_id) if relay is not None else None
        if owner is not None:
            await relay.websocket(ws, owner, _deny)
            return
        await _deny(ws, errors.http_status(errors.CALL_NOT_FOUND), f"unknown call_id {call_id!r}")
        return
    await ws.accept(subprotocol=_subprotocol(ws))

    async def sink(text: str) -> None:
        await ws.send_text(text)

    call.bind(sink)
    ended = asyncio.ensure_future(call.session.wait_closed())
    reader = _Reader(ws, ended)
    try:
        while True:
            msg = await reader.receive()
            if msg is None:  # the call's session ended (hangup, peer gone, engine lost): say so by closing
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.close(code=call.session.close_code), SEND_TIMEOUT_S)
                return
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("text") is not None:
                await call.session.handle_client_text(msg["text"])
    except WebSocketDisconnect:
        return
    finally:
        ended.cancel()
        call.unbind(sink)
