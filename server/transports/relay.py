"""A WebRTC call's HTTP requests and control WebSocket, carried to the server process that holds the call.

The call's peer connection (its media, its session) lives in the process that answered the offer; the
client's next connection may reach a sibling (`--workers`: the kernel picks a worker; `--ray`: Ray Serve's
ingress picks a front end replica). That sibling relays it to the owner: HTTP requests whole, the control socket
message by message (a control channel carries events only, a few per second; the audio stays on the call's
media tracks). Siblings say which process holds a call id and where it takes relayed requests: a worker's
private unix socket (server/workers/context.py), a front end replica's private TCP port
(server/cluster/peers.py). The owner checks the key and Origin again from the forwarded headers, so the
relay adds no trust of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import httpx
from fastapi import Request, WebSocket
from fastapi.responses import Response
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from server import auth

log = logging.getLogger("server.relay")

# Headers that describe one hop of a connection, not the request: never forwarded either way.
_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
        "content-encoding", "proxy-authorization", "proxy-connection"}
_WS_HEADERS = ("origin", "openai-beta", "user-agent")  # what the owner reads (the key goes as Authorization)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # what a subprotocol may be (RFC 7230 token)
_NO_STATUS = {1005, 1006}  # close codes that say "no code was sent": not sendable in a close frame
Deny = Callable[[WebSocket, int, str], Awaitable[None]]
CONNECT_TIMEOUT_S = 5.0  # a sibling that does not take the connection by then is not serving


@dataclass(frozen=True)
class Owner:
    """Where the process holding a call takes relayed requests: a unix socket path, or a TCP host and port."""

    name: str  # for logs: "worker 2", "front end 3fa9c2d1"
    uds: str | None = None
    host: str | None = None
    port: int = 0

    def __post_init__(self) -> None:
        if (self.uds is None) == (self.host is None) or (self.host is not None and not 0 < self.port < 65536):
            raise ValueError(f"an owner is reached by a unix socket or by a host and port, got {self!r}")

    @property
    def authority(self) -> str:
        if self.host is None:
            return "worker"  # any: the unix socket is the address
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Siblings(Protocol):
    """The processes serving the same calls API as this one."""

    @property
    def call_id_prefix(self) -> str:
        """What begins the ids of the calls this process answers: it tells siblings who holds them."""
        ...

    async def owner(self, call_id: str) -> Owner | None:
        """The sibling holding `call_id`; None when it is this process's or no sibling's."""
        ...


class CallRelay:
    def __init__(self, siblings: Siblings, timeout_s: float = 30.0) -> None:
        self.siblings = siblings
        self.timeout_s = timeout_s
        self._clients: dict[Owner, httpx.AsyncClient] = {}

    @property
    def call_id_prefix(self) -> str:
        return self.siblings.call_id_prefix

    async def owner(self, call_id: str) -> Owner | None:
        return await self.siblings.owner(call_id)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def _client(self, owner: Owner) -> httpx.AsyncClient:
        client = self._clients.get(owner)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=owner.uds)
            timeout = httpx.Timeout(self.timeout_s, connect=CONNECT_TIMEOUT_S)
            client = httpx.AsyncClient(transport=transport, base_url=f"http://{owner.authority}", timeout=timeout)
            self._clients[owner] = client
        return client

    async def _forget(self, owner: Owner) -> None:
        """An owner that cannot be reached is gone (a Ray replica comes back under another address)."""
        client = self._clients.pop(owner, None)
        if client is not None:
            await client.aclose()

    async def http(self, request: Request, owner: Owner) -> Response | None:
        """The owner's response to `request`; None when the owner cannot be reached (it died, with its calls)."""
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            r = await self._client(owner).request(request.method, target, headers=headers,
                                                  content=await request.body())
        except httpx.TransportError as e:
            log.warning("relay to %s failed: %s", owner.name, e)
            await self._forget(owner)
            return None
        return Response(r.content, status_code=r.status_code,
                        headers={k: v for k, v in r.headers.items() if k.lower() not in _HOP})

    async def websocket(self, ws: WebSocket, owner: Owner, deny: Deny) -> None:
        """Carry the control socket `ws` to `owner` until either side closes it."""
        uri = f"ws://{owner.authority}" + ws.url.path + (f"?{ws.url.query}" if ws.url.query else "")
        headers = [(k, ws.headers[k]) for k in _WS_HEADERS if k in ws.headers]
        # The key as a header whichever way the client gave it; the other subprotocols as offered (tokens only:
        # the WebSocket client here refuses anything else, and uvicorn already answered such offers with 400).
        key = auth.presented_key(ws.headers, {})
        if key:
            headers.append(("authorization", f"Bearer {key}"))
        offered = [p for p in auth.offered_subprotocols(ws.headers)
                   if not p.startswith(auth.KEY_SUBPROTOCOL_PREFIX) and _TOKEN.fullmatch(p)]
        options = {"additional_headers": headers, "subprotocols": offered or None, "max_size": None,
                   "ping_interval": None, "open_timeout": CONNECT_TIMEOUT_S}
        try:
            if owner.uds is not None:
                upstream = await unix_connect(owner.uds, uri, **options)
            else:
                upstream = await connect(uri, **options)
        except InvalidStatus as e:  # the owner refused: say what it said
            reason = e.response.body.decode("utf-8", "replace") if e.response.body else "refused"
            await deny(ws, e.response.status_code, reason)
            return
        except (OSError, TimeoutError, InvalidHandshake, ValueError) as e:
            log.warning("relay to %s failed: %s", owner.name, e)
            await deny(ws, 404, f"unknown call_id ({owner.name}, which held the call, is gone)")
            return
        async with upstream:
            await ws.accept(subprotocol=upstream.subprotocol)
            await _pipe(ws, upstream)


async def _pipe(ws: WebSocket, upstream: ClientConnection) -> None:
    async def client_to_owner() -> int:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return int(msg.get("code") or 1000)
            if msg.get("text") is not None:
                await upstream.send(msg["text"])
            elif msg.get("bytes") is not None:
                await upstream.send(msg["bytes"])

    async def owner_to_client() -> None:
        async for data in upstream:
            if isinstance(data, str):
                await ws.send_text(data)
            else:
                await ws.send_bytes(data)

    inbound = asyncio.create_task(client_to_owner())
    outbound = asyncio.create_task(owner_to_client())
    try:
        done, _ = await asyncio.wait({inbound, outbound}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (inbound, outbound):
            t.cancel()
        for t in (inbound, outbound):
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed, WebSocketDisconnect, RuntimeError):
                await t
    if inbound in done and inbound.exception() is None:  # the client left: close the owner's side the same way
        code = inbound.result()
        with contextlib.suppress(Exception):  # noqa: BLE001 - gone already, or a code a close frame cannot carry
            await upstream.close(code if code not in _NO_STATUS else 1000)
        return
    code = upstream.close_code
    if code is None or code in _NO_STATUS:  # the owner went away without a close frame
        code = 1011
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):
        await ws.close(code=code, reason=upstream.close_reason or "")
