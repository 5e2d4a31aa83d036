"""The engine process's serving loop: a ZeroMQ ROUTER socket around the Service (service.py).

Wire: clients connect DEALER sockets (several server processes may share one engine); each frame
is one msgpack message of engines.protocol.messages (a REQ-style empty delimiter frame is accepted
and echoed). Replies about a session go to the client that opened it; Pong and errors about
malformed frames go to the sender. A bad message never ends the process: it is answered with
`Error` (see service.py for the per-message rules).

Loop: poll without blocking while the engine has work, else wait up to 50 ms; each iteration drains
every waiting message, then runs one engine step and sends what it produced. While the step runs on the GPU
the loop keeps polling: decoded audio the codec worker posts meanwhile is sent, and user audio and commits that
arrive go to the encoder's thread at once (other messages wait for the step's end). SIGTERM or SIGINT ends
the loop after the current step. A client that sends nothing (not even its once-a-second Ping) for
`--client-timeout-s` is taken for dead (a server worker killed, a host gone): its sessions are
closed as if it had sent CloseSession, so their KV blocks return to the pool. When idle (at most
every 10 s, after work) the KV pool's integrity is checked. An exception inside an engine step (or a
failed check) leaves the engine's state unknown: every session with a live response gets
`Error(engine_error)` and `ResponseDone(failed)`, and the process exits with status 1 so the
supervisor restarts it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from engines.process.observe.load_log import LoadLog
from engines.process.observe.stall_watch import StallWatch
from engines.process.options import CLIENT_TIMEOUT_S
from engines.process.outputs import Out
from engines.process.service import SLOW_STEP_S as SLOW_S
from engines.process.service import Service
from engines.protocol import errors
from engines.protocol import messages as m

log = logging.getLogger("engines.process")

IDLE_POLL_MS = 50
WAIT_POLL_MS = 2
INTEGRITY_EVERY_S = 10.0
MAX_DRAIN = 1024  # messages handled between two engine steps, so a flood cannot stall decoding
# While the engine waits for a step's tokens, decoded audio leaves and user audio and commits reach the encoder
# (EngineServer._while_stepping): the loop looks for them this often (a step takes ~5-12 ms under load).
STEP_POLL_S = 0.0002


class EngineServer:
    """The ROUTER socket around a Service."""

    def __init__(self, service: Service, endpoint: str, ctx: zmq.Context | None = None,
                 client_timeout_s: float = CLIENT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 window: Any = None) -> None:
        if client_timeout_s <= 0:
            raise ValueError(f"client_timeout_s must be > 0, got {client_timeout_s}")
        self.service = service
        service.step_wait = self._while_stepping
        self._later: list[tuple[bytes, Any]] = []  # received during a step, to be handled after it (in order)
        self.endpoint = endpoint
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self._envelopes: dict[bytes, list[bytes]] = {}  # identity -> frames between it and the payload
        self.client_timeout_s = client_timeout_s
        self._clock = clock
        self._last_heard: dict[bytes, float] = {}  # identity -> when its last message arrived
        self._next_expiry = 0.0
        self.stopping = False
        self._last_check = 0.0
        self._busy_since_check = False
        self.watch = StallWatch(threshold_s=SLOW_S)
        self._load = LoadLog(service, self.watch)
        self.window = window  # a gpu_window.GpuWindow, polled every loop turn

    def close(self) -> None:
        if self.window is not None:
            self.window.finish()
        self.watch.close()
        self.sock.close(0)

    def _send(self, outs: list[Out]) -> None:
        for client, msg in outs:
            frames = [client, *self._envelopes.get(client, []), m.encode(msg)]
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # a client that stopped reading: drop rather than stall every session
                log.warning("dropped %s for a client that does not read", type(msg).__name__)

    def _read(self, most: int) -> list[tuple[bytes, Any]]:
        """Up to `most` waiting messages, decoded (a malformed one is answered here)."""
        items: list[tuple[bytes, Any]] = []
        while len(items) < most:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            client, payload = frames[0], frames[-1]
            self._envelopes[client] = frames[1:-1]
            self._last_heard[client] = self._clock()
            try:
                items.append((client, m.decode(payload)))
            except m.MessageError as e:
                self._send([(client, m.Error(None, errors.INVALID_REQUEST, str(e)))])
        return items

    def _while_stepping(self) -> bool:
        """Engine.step's `on_wait`, on this thread, while the GPU runs a step: user audio and commits that came
        meanwhile go to the encoder, and decoded audio goes out (Service.handle_early, Service.while_stepping); the
        rest of the messages wait for the step's end. Always True: the step's wait goes on polling."""
        if len(self._later) < MAX_DRAIN and self.sock.poll(0, zmq.POLLIN):
            t0 = time.perf_counter()
            items = self._read(MAX_DRAIN - len(self._later))
            try:
                self._later += self.service.handle_early(items)
            except Exception as e:  # noqa: BLE001 - as in _recv_all: a bug on some message must not end the engine
                self._fail_messages(items, e)
            self._load.handled(time.perf_counter() - t0)
        self._send(self.service.while_stepping())
        time.sleep(STEP_POLL_S)
        return True

    def _fail_messages(self, items: list[tuple[bytes, Any]], e: Exception) -> None:
        log.exception("error handling %d messages", len(items))
        self._send([(client, m.Error(getattr(msg, "session_id", None), errors.ENGINE_ERROR, f"{type(e).__name__}: {e}",
                                     getattr(msg, "response_id", None))) for client, msg in items])

    def _recv_all(self) -> None:
        """Drain the socket; decoded messages are handled together (speech is encoded in one batch), after those
        put off during the last step."""
        items, self._later = self._later, []
        items += self._read(MAX_DRAIN - len(items))
        if not items:
            return
        t0 = time.perf_counter()
        try:
            outs = self.service.handle_many(items)
        except Exception as e:  # noqa: BLE001 - a bug on some message must not take the engine down
            self._fail_messages(items, e)
            outs = []
        self._send(outs)
        if time.perf_counter() - t0 > SLOW_S:  # the engine loop waits for this: say what was slow to handle
            kinds: dict[str, int] = {}
            for _, msg in items:
                kinds[type(msg).__name__] = kinds.get(type(msg).__name__, 0) + 1
            log.warning("slow message handling %.0f ms: %s", 1e3 * (time.perf_counter() - t0), kinds)

    def expire_silent_clients(self) -> list[str]:
        """Close every session of a client silent for client_timeout_s; returns the closed session ids."""
        now = self._clock()
        if now < self._next_expiry:
            return []
        self._next_expiry = now + min(1.0, self.client_timeout_s / 4)
        silent = {c for c, t in self._last_heard.items() if now - t > self.client_timeout_s}
        if not silent:
            return []
        for client in silent:
            del self._last_heard[client]
            self._envelopes.pop(client, None)
        closes = [(s.owner, m.CloseSession(sid)) for sid, s in self.service.sessions.items() if s.owner in silent]
        if closes:
            log.warning("%d client(s) silent for over %.0f s: closing their %d session(s)", len(silent),
                        self.client_timeout_s, len(closes))
            try:
                self._send(self.service.handle_many(closes))  # nobody reads these; the ROUTER drops them
            except Exception:  # noqa: BLE001 - as in _recv_all: a bug on one close must not end the engine
                log.exception("error closing the sessions of silent clients")
        return [msg.session_id for _, msg in closes]

    def run_once(self, timeout_ms: int | None = None) -> None:
        if timeout_ms is None:
            if self.service.engine.has_work():
                timeout_ms = 0
            else:  # only the codec worker (or held audio) is busy: wait a little instead of spinning on the GIL
                timeout_ms = WAIT_POLL_MS if self.service.has_work() else IDLE_POLL_MS
        if self._later or self.sock.poll(timeout_ms, zmq.POLLIN):
            t0 = time.perf_counter()
            with self.watch.section("message handling"):
                self._recv_all()
            self._load.handled(time.perf_counter() - t0)
        self.expire_silent_clients()
        if self.window is not None:
            self.window.poll(len(self.service.sessions))
        if self.service.has_work():
            t0 = time.perf_counter()
            try:
                with self.watch.section("engine step"):
                    outs = self.service.step()
            except Exception:
                log.exception("engine step failed; failing live responses and exiting")
                self._send(self._fail_all())
                raise
            self._send(outs)
            self._load.stepped(time.perf_counter() - t0)
            self._busy_since_check = True
            self._load.maybe_log()
        elif self._busy_since_check and time.monotonic() - self._last_check > INTEGRITY_EVERY_S:
            # Idle: verify the KV pool's books (free + used == total) once in a while.
            self._last_check, self._busy_since_check = time.monotonic(), False
            try:
                self.service.engine.check_integrity()
            except Exception:
                log.exception("KV integrity check failed; exiting so the supervisor restarts the engine")
                raise

    def _fail_all(self) -> list[Out]:
        outs: list[Out] = []
        for s in self.service.sessions.values():
            r = s.active.response if s.active is not None else None
            if r is not None:
                outs.append((s.owner, m.Error(s.session_id, errors.ENGINE_ERROR, "engine step failed", r.response_id)))
                outs.append((s.owner, m.ResponseDone(s.session_id, r.response_id, "failed",
                                                     reason=errors.ENGINE_ERROR)))
        return outs

    def serve_forever(self) -> None:
        while not self.stopping:
            self.run_once()

