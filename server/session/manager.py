"""Creates sessions under the server's limits and tracks them for metrics and graceful drain.

Transports call `manager.create(audio_out=...)` (raises ServerBusy / EngineUnavailable / Draining with a
stable `code`), then `await session.start()`. The manager forgets a session when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from engines.protocol import errors
from server.session import server_events as ev
from server.session.engine_link import EngineLink
from server.session.session import AudioOutMode, Session, SessionLimits, SessionObserver
from server.workers.slots import Slots

log = logging.getLogger("server.sessions")

# After the drain closed its sessions, how long their sockets may take to send what is queued and a close frame
# (the WebSocket route gives each 5 s) before uvicorn's own shutdown closes whatever is left with 1012.
CLOSE_GRACE_S = 10.0


class SessionRefused(Exception):
    code: str  # each kind's stable code (engines.protocol.errors)

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ServerBusy(SessionRefused):
    code = errors.SERVER_BUSY


class EngineUnavailable(SessionRefused):
    code = errors.ENGINE_UNAVAILABLE


class Draining(SessionRefused):
    code = errors.SERVER_SHUTTING_DOWN


class Placement(Protocol):
    """The engines sessions are placed on (server.engine_pool.EnginePool)."""

    ready: bool

    def pick(self) -> EngineLink | None: ...


class SessionManager:
    def __init__(self, engines: Placement, *, max_sessions: int, limits: SessionLimits, model: str,
                 vad_factory: Callable[[], Any] | None = None, observer: SessionObserver | None = None,
                 slots: Slots | None = None) -> None:
        self.engines = engines
        # The admission count and its limit: this process's sessions, or the whole server's under --workers.
        self.slots = slots if slots is not None else Slots(max_sessions)
        self.limits = limits
        self.model = model
        self.vad_factory = vad_factory
        self.observer = observer
        self.sessions: dict[str, Session] = {}
        self.draining = False
        self._transports = 0  # client sockets open on this process (see `transport`)
        self._no_transports = asyncio.Event()
        self._no_transports.set()

    def __len__(self) -> int:
        return len(self.sessions)

    def create(self, audio_out: AudioOutMode = "events") -> Session:
        if self.draining:
            raise Draining("the server is shutting down")
        engine = self.engines.pick()
        if engine is None:
            raise EngineUnavailable("the engine is not ready (starting or restarting); retry shortly")
        if not self.slots.try_take():
            raise ServerBusy(f"the server is at its limit of {self.slots.limit} sessions; retry later")
        sid = ev.new_id("sess")
        try:
            s = Session(sid, engine, model=self.model, limits=self.limits, audio_out=audio_out,
                        vad_factory=self.vad_factory, observer=self.observer, on_closed=self._forget)
        except BaseException:
            self.slots.put_back()
            raise
        self.sessions[sid] = s
        # Counted on its engine now, not at start(): the next session's placement must see this one.
        engine.register(sid, s)
        return s

    @contextlib.asynccontextmanager
    async def transport(self) -> AsyncIterator[None]:
        """Held by a route for as long as its client socket is open, so that the drain returns only once every
        socket has said why it closes (1001 after `server_shutting_down`, or the relayed owner's code)."""
        self._transports += 1
        self._no_transports.clear()
        try:
            yield
        finally:
            self._transports -= 1
            if self._transports == 0:
                self._no_transports.set()

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def in_use(self) -> int:
        """Sessions open on the whole server (all workers)."""
        return self.slots.in_use()

    def _forget(self, s: Session) -> None:
        if self.sessions.pop(s.id, None) is not None:
            self.slots.put_back()

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting sessions; let answers in progress finish (up to timeout_s; one still running then ends
        `cancelled`, reason `server_shutting_down`), close all, then wait for the client sockets to close (up to
        what is left of timeout_s plus CLOSE_GRACE_S)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(s.response_active for s in self.sessions.values()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for s in list(self.sessions.values()):
            await s.cut_answer(errors.SERVER_SHUTTING_DOWN)  # its response.done (cancelled) comes first
            s.error(errors.SERVER_SHUTTING_DOWN, "the server is shutting down")
            await s.close("server_shutdown", errors.close_code(errors.SERVER_SHUTTING_DOWN))
        # A socket relayed to a sibling worker closes when that worker's drain closes the call's session.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_transports.wait(), max(deadline - loop.time(), 0.0) + CLOSE_GRACE_S)
        log.info("drained (%d client sockets still open)", self._transports)
