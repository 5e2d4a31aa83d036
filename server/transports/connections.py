"""The server's connections under uvicorn: a deadline on each request head, and a WebSocket that measures what its
client has taken.

uvicorn gives a connection that has not finished sending its request head no deadline: a client that sends a
header a minute (slowloris) holds its socket, and its file descriptor, for ever. `http_protocol(timeout)` is
uvicorn's h11 protocol with such a deadline (the first request's head and each later one on a kept-alive
connection, the WebSocket upgrade included); h11, not httptools, because h11 also bounds a head's size.

`RealtimeWebSocket` is uvicorn's sans-I/O WebSocket protocol that counts the bytes it writes and exposes a
`SendMeter` in the scope's extensions (`SEND_METER`): bytes written minus the bytes still waiting (the transport's
buffer plus, on Linux, the kernel's send queue: sent but not acknowledged by the peer's TCP) is what the client has
taken. A client that stopped reading takes nothing while bytes wait for it, however large the kernel's buffers; a
client that reads keeps taking, however many events it is sent. `SendMeter.send_final` writes a last event and the
close frame past the flow control that a stalled client holds shut, and aborts the connection if the client never
reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import struct
import sys
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger("server.transports.connections")

SEND_METER = "moss.send_meter"  # the scope extension holding a WebSocket's SendMeter
# After the last event and close frame to a client that stopped reading, how long it has to read them before the
# connection is aborted (a transport's close would wait for a reader that never comes).
FINAL_GRACE_S = 10.0
_TIOCOUTQ = 0x5411  # Linux: bytes in a TCP socket's send queue (unsent, or sent and not acknowledged)


def http_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head has not arrived within `header_timeout_s`
    (of the connection opening, or of the previous response ending on a kept-alive connection)."""

    class HeadDeadlineProtocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _armed_for: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._armed_for = self.scope  # a request whose head arrives replaces the scope (an upgrade too)
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_deadline)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline(self) -> None:
            self._head_timer = None
            if self.scope is self._armed_for and not self.transport.is_closing():
                log.info("%s: no request head within %g s: closing", _peer(self.client), header_timeout_s)
                self.transport.close()

    return HeadDeadlineProtocol


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"


class _CountingTransport:
    """The transport, counting the bytes written to it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class SendMeter:
    """What a WebSocket's client has taken of what the server wrote to it."""

    def __init__(self, protocol: RealtimeWebSocket, transport: _CountingTransport) -> None:
        self._protocol = protocol
        self._transport = transport
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None and sys.platform == "linux" else None

    def waiting(self) -> int:
        """Bytes written that the client's TCP has not acknowledged yet: in the transport's buffer, and in the
        kernel's send queue where the platform tells (Linux)."""
        queued = self._transport.get_write_buffer_size()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                queued += struct.unpack("i", fcntl.ioctl(self._fd, _TIOCOUTQ, b"\0\0\0\0"))[0]
        return queued

    def taken(self) -> int:
        """Bytes the client has taken since the connection opened."""
        return self._transport.written - self.waiting()

    def send_final(self, text: str, code: int, reason: str = "") -> None:
        """`text`, then a close frame with `code`, past the flow control; abort the connection FINAL_GRACE_S later
        unless the client has read them and answered the close by then."""
        p = self._protocol
        if p.close_sent or p.transport.is_closing():
            return
        p.stop_keepalive()
        p.conn.send_text(text.encode())
        p.conn.send_close(code, reason)
        p.transport.write(b"".join(p.conn.data_to_send()))
        p.close_sent = True
        p.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        if p.read_paused:  # the client's close frame must be read for the handshake to end
            p.read_paused = False
            p.transport.resume_reading()
        p.close_timer = p.loop.call_later(FINAL_GRACE_S, p.transport.abort)


class RealtimeWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol with a SendMeter in each connection's scope."""

    def connection_made(self, transport: Any) -> None:
        counting = _CountingTransport(transport)
        super().connection_made(counting)  # type: ignore[arg-type]
        self.meter = SendMeter(self, counting)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # None: the handshake was refused
        if scope is not None:
            scope["extensions"][SEND_METER] = self.meter
