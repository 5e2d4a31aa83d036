"""A front end replica's siblings under `serve --ray`: the one holding a call, found by the call's id.

Ray Serve's ingress may send a WebRTC call's requests and control socket to any front end replica, but the call (its
peer connection, its session) lives in the one that answered the offer. So with several front ends each one puts a
random tag in the ids of the calls it answers, serves the calls' routes (those alone) on a private TCP port of its
node, and lists its tag with that address in the directory every HEARTBEAT_S (server/cluster/directory.py). A front
end that gets a request for another's call asks the directory where that one listens and relays the request there
(server/transports/relay.py); the owner checks the key and Origin again, as for any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import socket
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from fastapi import FastAPI
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.cluster.directory import HEARTBEAT_S, FrontendEntry
from server.serving import uvicorn_config
from server.transports.relay import Owner

log = logging.getLogger("server.cluster")

_CALL_ID = re.compile(r"rtc_r([0-9a-f]{8})_[0-9a-f]+", re.ASCII)
# What a sibling relays: a call's state, hang-up and voice, and its control socket (`/v1/realtime?call_id=`).
_CALL_ROUTE = re.compile(r"/v1/realtime/calls/[^/]+(/hangup|/voice)?")
CONTROL_SOCKET = "/v1/realtime"
LOOKUP_TIMEOUT_S = 2.0  # a directory that does not answer by then: the call is reported unknown (404)


def relayed_only(app: ASGIApp) -> ASGIApp:
    """`app` for what siblings relay; anything else on the relay port is refused (404, a WebSocket 403)."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _CALL_ROUTE.fullmatch(scope["path"]):
            await app(scope, receive, send)
        elif scope["type"] == "websocket" and scope["path"] == CONTROL_SOCKET \
                and parse_qs(scope["query_string"].decode("latin-1")).get("call_id"):
            await app(scope, receive, send)
        elif scope["type"] == "http":
            await PlainTextResponse("not a relayed call request", status_code=404)(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    return asgi


class _RelayServer(uvicorn.Server):
    """uvicorn on the replica's own event loop, next to Ray's: the process's signals stay Ray's."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = asyncio.Event()

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.up.set()


async def _ask(method: Any, *args: Any) -> Any:
    return await method.remote(*args)


class FrontendPeers:
    """server.transports.relay.Siblings for a front end replica; `directory`: the EngineDirectory's handle, `host`:
    the node's address (where the relay port listens)."""

    def __init__(self, directory: Any, host: str, replica: str) -> None:
        self.tag = secrets.token_hex(4)
        self._directory = directory
        self._host = host
        self._replica = replica
        self.port: int | None = None  # while serving

    @property
    def call_id_prefix(self) -> str:
        return f"rtc_r{self.tag}_"

    async def owner(self, call_id: str) -> Owner | None:
        match = _CALL_ID.fullmatch(call_id)
        if match is None or match.group(1) == self.tag:
            return None
        try:
            entry = await asyncio.wait_for(_ask(self._directory.frontend, match.group(1)), LOOKUP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the directory restarting: as if no front end held the call
            log.warning("the directory did not say where front end %s is", match.group(1), exc_info=True)
            return None
        if entry is None:  # that front end is gone (its calls with it)
            return None
        e = FrontendEntry(**entry)
        return Owner(f"front end {e.tag}", host=e.host, port=e.port)

    def attach(self, app: FastAPI) -> None:
        """Serve `app`'s relayed requests while it runs: from after its start-up until after its shutdown (which
        ends its calls, and so the control sockets relayed to them, with their own close codes)."""
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
            async with self.serving(app):
                async with inner(a) as state:
                    yield state

        app.router.lifespan_context = lifespan

    @contextlib.asynccontextmanager
    async def serving(self, app: FastAPI) -> AsyncIterator[None]:
        sock = socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self._host, 0))
        self.port = sock.getsockname()[1]
        server = _RelayServer(uvicorn_config(app, self._host, self.port, "warning", lifespan="off",
                                             asgi=relayed_only(app)))
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="call-relay-server")
        up = asyncio.create_task(server.up.wait())
        await asyncio.wait({serving, up}, return_when=asyncio.FIRST_COMPLETED)
        up.cancel()
        if serving.done():
            sock.close()
            raise RuntimeError(f"the call relay port {self._host}:{self.port} did not start") from serving.exception()
        entry = asdict(FrontendEntry(tag=self.tag, host=self._host, port=self.port, replica=self._replica))
        heartbeat = None
        try:
            await _ask(self._directory.frontend_heartbeat, entry)  # listed before it answers any offer
            heartbeat = asyncio.create_task(self._renew(entry), name="frontend-directory")
            log.info("front end %s takes relayed call requests at %s:%d", self.tag, self._host, self.port)
            yield
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_ask(self._directory.frontend_leave, self.tag), HEARTBEAT_S)
            server.should_exit = True
            await serving
            self.port = None

    async def _renew(self, entry: dict[str, Any]) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            # The directory restarting: the next beat lists this front end again.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_ask(self._directory.frontend_heartbeat, entry), HEARTBEAT_S)
