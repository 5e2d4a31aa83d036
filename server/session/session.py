"""One realtime conversation, independent of its transport (WebSocket JSON, WebRTC tracks, tests).

Interface for transports (the WebSocket route and the WebRTC peer both drive a Session this way):

    session = manager.create(audio_out="events" | "track")   # server.session.manager; raises ServerBusy
    await session.start()                          # opens the engine session, queues `session.created`
    # inbound, from any task of the same event loop:
    await session.handle_client_event(event_dict)  # a parsed client event (OpenAI Realtime GA shape)
    await session.handle_client_text(text)         # raw JSON text (malformed JSON -> `error` event)
    await session.feed_audio(pcm, rate)            # float32 mono in [-1, 1] at any rate (WebRTC mic);
                                                   # same path as input_audio_buffer.append
    session.audio_played(response_id, samples)     # track transports: cumulative 24 kHz samples of that
                                                   # response actually played (barge-in truncates there)
    # outbound, one consumer:
    item = await session.outbound.get()            # dict event, or AudioOut in "track" mode; None = ended
    await session.close(reason)                    # idempotent: cancels the answer, closes the engine session
    session.closed / await session.wait_closed() / session.close_code (WebSocket close code to use)

`audio_out="events"` sends answer audio as `response.output_audio.delta` events (base64 PCM16 24 kHz);
`audio_out="track"` puts `server.session.pacing.AudioOut` items (raw PCM16 24 kHz) on the same ordered
stream instead and sends no audio deltas; every other event is the same in both modes.

Everything runs on one asyncio loop. The engine client calls `on_engine_message` / `on_engine_lost`
from its receive task; nothing here blocks (the outbound stream is bounded and never awaited on put).

The Session wires its parts, each in a module of its own: client_handlers (what each client event does),
input_buffer (user audio, resampled, committed or cleared), turn_detection (server VAD turns and barge-in),
responses (answers: the engine's output as events, cancel, end), engine_link (conversation inputs to the engine,
in order), pacing (the outbound stream and the listener's playback); client_events parses settings and
server_events builds events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from engines.process.options import MAX_TEXT_CHARS
from engines.protocol import errors
from engines.protocol import messages as m
from server.session import items
from server.session import server_events as ev
from server.session.client_events import MAX_OUTPUT_TOKENS_DEFAULT, SessionConfig
from server.session.client_handlers import HANDLERS
from server.session.client_json import ProtocolError, decode_client_event
from server.session.engine_link import EngineInputs, EngineLink
from server.session.idle import IdleTimeout
from server.session.input_buffer import CLIENT_RATE, InputBuffer
from server.session.pacing import Outbound
from server.session.responses import Responses
from server.session.tasks import Background
from server.session.turn_detection import TurnDetector

log = logging.getLogger("server.session.session")

AudioOutMode = Literal["events", "track"]


class SessionObserver(Protocol):
    """Metrics hooks (server.ops.metrics.Metrics implements them); all optional to call."""

    def error(self, code: str) -> None: ...

    def ttfa(self, seconds: float) -> None: ...

    def rtf(self, value: float) -> None: ...

    def underrun(self, seconds: float) -> None: ...

    def speculation(self, withdrawn: bool, wasted_rows: int = 0) -> None: ...

    def turn_end(self, silence_s: float) -> None: ...


@dataclass(frozen=True)
class SessionLimits:
    max_message_bytes: int = 1 << 20
    max_input_buffer_seconds: float = 60.0
    output_queue_size: int = 512
    idle_timeout_s: float | None = None  # None: a session that sends nothing stays open
    max_answer_rows: int = MAX_OUTPUT_TOKENS_DEFAULT  # an answer's length when the client sets no limit ("inf")
    max_text_chars: int = MAX_TEXT_CHARS  # the longest instructions or item text; the engine's bound (its option)

    def __post_init__(self) -> None:
        if self.idle_timeout_s is not None and self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0 or None, got {self.idle_timeout_s}")
        if self.max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {self.max_text_chars}")


class Session:
    def __init__(
        self,
        session_id: str,
        engine: EngineLink,
        *,
        model: str = "moss-speech",
        limits: SessionLimits | None = None,
        audio_out: AudioOutMode = "events",
        vad_factory: Callable[[], Any] | None = None,
        observer: SessionObserver | None = None,
        on_closed: Callable[[Session], None] | None = None,
    ) -> None:
        self.id = session_id
        self.engine = engine
        self.limits = limits or SessionLimits()
        self.audio_out = audio_out
        self.config = SessionConfig(model=model, max_answer_rows=self.limits.max_answer_rows)
        if vad_factory is None:  # no server_vad here: clients commit their turns
            self.config = dataclasses.replace(self.config, turn_detection=None)
        self.observer = observer
        self._on_closed = on_closed
        self.log = logging.LoggerAdapter(log, {"session_id": session_id})
        self.tasks = Background(session_id, self.log, self._background_failed)
        self.outbound = Outbound(self.limits.output_queue_size, overflow_event=self.slow_consumer_error)
        self.closed = False
        self.close_code = errors.CLOSE_NORMAL
        self.close_reason = ""  # the close frame's reason, where the code alone does not say why
        self._last_heard = time.monotonic()  # when the client last sent an event or audio
        # One client event at a time, in arrival order: a call's data channel, control socket and voice upload hand
        # events over at once, and a handler may wait half-way (a model's load, the engine's sync).
        self._event_turn = asyncio.Lock()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._closed_event = asyncio.Event()
        self._started = False
        self.items: list[str] = []  # conversation item ids in order
        self.item_objs: dict[str, dict[str, Any]] = {}  # each item as its last conversation.item.done showed it
        self.item_audio_samples: dict[str, int] = {}  # assistant items: 24 kHz samples of answer audio sent
        self.model_asked_logged = False  # a client's other `model` name is logged once per session
        self.engine_inputs = EngineInputs(session_id, engine, self.tasks, lambda: self.closed)
        self.input_buffer = InputBuffer(self)
        self.turns = TurnDetector(self, vad_factory)
        self.responses = Responses(self)
        self.idle = IdleTimeout(self)
        self.usage_totals = {"input_rows": 0, "output_rows": 0}

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.engine.register(self.id, self)
        self._started = True
        if self.config.turn_detection is not None:
            await self.turns.ensure_vad()
        await self.engine.send(m.OpenSession(session_id=self.id, instructions=self.config.instructions))
        self.emit(ev.session_event("session.created", self.id, self.config))
        self.log.info("session opened audio_out=%s", self.audio_out)
        self._check_idle()

    async def close(self, reason: str = "client_closed", code: int = errors.CLOSE_NORMAL) -> None:
        if self.closed:
            return
        self.closed = True
        self.idle.disarm()
        self.engine_inputs.stop()
        if self.close_code == errors.CLOSE_NORMAL:
            self.close_code = code
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        r = self.responses.active
        try:
            if self._started and self.engine.ready:
                if r is not None and not r.cancel_sent:
                    await self.engine.send(m.CancelResponse(session_id=self.id, response_id=r.id))
                await self.engine.send(m.CloseSession(session_id=self.id))
        except Exception as e:  # noqa: BLE001 - closing must not fail because the engine went away
            self.log.warning("engine close failed: %s", e)
        finally:
            self.engine.unregister(self.id)
            self.outbound.close()
            self._closed_event.set()
            if self._on_closed is not None:
                self._on_closed(self)
            self.log.info("session closed reason=%s", reason)

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def _check_idle(self) -> None:
        """Close the session once the client has sent nothing (no event, no audio) for the idle timeout while no
        answer ran: a forgotten or half-open connection must not hold a session slot for ever. (A timer, not a
        task per session.)"""
        timeout_s = self.limits.idle_timeout_s
        if self.closed or timeout_s is None:
            return
        now = time.monotonic()
        if self.response_active:  # an answer playing is not idleness
            self._last_heard = now
        due = self._last_heard + timeout_s
        if now < due:
            self._idle_timer = asyncio.get_running_loop().call_later(due - now, self._check_idle)
            return
        self._idle_timer = None
        self.error(errors.SESSION_IDLE_TIMEOUT, f"no client event or audio for {timeout_s:g} s; closing")
        self.close_code = errors.close_code(errors.SESSION_IDLE_TIMEOUT)
        self.close_reason = "idle timeout"
        self.tasks.spawn(self.close("idle_timeout", self.close_code), "close")

    async def cut_answer(self, reason: str) -> None:
        """End the answer in progress now as `cancelled` with `reason` (the drain ran out of time): the client gets
        its `response.done` before whatever ends the session."""
        r = self.responses.active
        if r is None:
            return
        if not r.cancel_sent and self._started and self.engine.ready:
            r.cancel_sent = True
            try:
                await self.engine.send(m.CancelResponse(session_id=self.id, response_id=r.id))
            except Exception as e:  # noqa: BLE001 - the session closes next whatever the engine says
                self.log.warning("engine cancel failed: %s", e)
        if self.responses.active is r:
            self.responses.finish(r, "cancelled", reason)

    @property
    def response_active(self) -> bool:
        return self.responses.active is not None

    # ---- inbound: client events and audio ----------------------------------------------------

    async def handle_client_text(self, text: str) -> None:
        self._last_heard = time.monotonic()
        try:
            event = decode_client_event(text)
        except ProtocolError as e:
            self.error(e.code, e.message, now=True)
            return
        await self.handle_client_event(event)

    async def handle_client_event(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        self._last_heard = time.monotonic()
        async with self._event_turn:
            if not self.closed:
                await self._handle(event)

    async def _handle(self, event: dict[str, Any]) -> None:
        etype = event.get("type")
        client_event_id = event.get("event_id")
        handler = HANDLERS.get(etype) if isinstance(etype, str) else None
        if handler is None:
            self.error(errors.UNKNOWN_EVENT, f"unknown or unsupported client event type {etype!r}",
                       param="type", event_id=client_event_id, now=True)
            return
        try:
            await handler(self, event)
        except ProtocolError as e:
            self.error(e.code, e.message, param=e.param, event_id=client_event_id, now=True)
        except Exception as e:  # noqa: BLE001 - a server bug on one event must not end the conversation
            self.log.exception("failed to handle %s", etype)
            self.error(errors.SERVER_ERROR, f"internal error handling {etype}: {type(e).__name__}",
                       event_id=client_event_id, now=True)

    async def feed_audio(self, pcm: np.ndarray, rate: int) -> None:
        """Microphone audio from a track transport: float32 mono in [-1, 1] at `rate` Hz.

        Raises ProtocolError (e.g. `input_audio_buffer_too_large`) for audio the session refuses; the
        transport decides how to report it (an `append` event gets an `error` event instead)."""
        if self.closed:
            return
        self._last_heard = time.monotonic()
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        await self.input_buffer.add(pcm, rate, client_samples=int(round(len(pcm) * CLIENT_RATE / rate)))

    def audio_played(self, response_id: str, samples: int) -> None:
        self.responses.audio_played(response_id, samples)

    # ---- engine messages ---------------------------------------------------------------------

    def on_engine_message(self, msg: Any) -> None:
        if isinstance(msg, m.Synced):
            self.engine_inputs.synced(msg.seq)
            return
        if self.closed or items.on_engine_message(self, msg):
            return
        self.responses.on_engine_message(msg)

    def on_engine_lost(self) -> None:
        """The engine process died: the history is gone, so this conversation ends with an error."""
        if self.closed:
            return
        r = self.responses.active
        if r is not None:
            self.responses.fail(r, errors.ENGINE_UNAVAILABLE, "the engine process stopped")
        self.error(errors.ENGINE_UNAVAILABLE, "the engine process stopped; this session has ended, please reconnect")
        self.close_code = errors.close_code(errors.ENGINE_UNAVAILABLE)
        self._started = False  # nothing to close on the (new) engine
        self.tasks.spawn(self.close("engine_lost", self.close_code), "close")

    # ---- the conversation's items ------------------------------------------------------------

    def add_item(self, item_id: str, role: str, content: list[dict[str, Any]]) -> None:
        self.item_objs[item_id] = ev.item(item_id, role, content, status="completed")
        self.append_item(item_id)

    def append_item(self, item_id: str) -> None:
        """A completed item (in item_objs) goes at the end of the conversation, and the client is told."""
        prev = self.items[-1] if self.items else None
        self.items.append(item_id)
        item = self.item_objs[item_id]
        self.emit(ev.event("conversation.item.added", previous_item_id=prev, item=item))
        self.emit(ev.event("conversation.item.done", previous_item_id=prev, item=item))

    def prev_of(self, item_id: str) -> str | None:
        i = self.items.index(item_id) if item_id in self.items else 0
        return self.items[i - 1] if i > 0 else None

    # ---- outbound ----------------------------------------------------------------------------

    def emit(self, event: dict[str, Any], on_taken: Callable[[], None] | None = None, keep: bool = False,
             now: bool = False) -> None:
        """`keep`: the event answers a client event, and goes out even if the speculative answer it was held with
        is withdrawn (turn_detection.py); `now`: it goes out at once, even while such an answer is held."""
        if not self.outbound.put(event, on_taken=on_taken, keep=keep, now=now):
            self.slow_consumer()

    def error(self, code: str, message: str, *, param: str | None = None, event_id: Any = None,
              now: bool = False) -> None:
        """An `error` event for the client (`code` from engines.protocol.errors, which gives its type). `now`: it
        answers a client event, about the conversation as the client sees it, so it goes out at once even while a
        speculative answer is held."""
        if self.observer is not None:
            self.observer.error(code)
        self.log.info("error code=%s message=%s", code, message)
        self.emit(ev.error_event(code, message, param=param, event_id=event_id), now=now)

    def _background_failed(self, name: str) -> None:
        """A task this session started failed (logged by Background): end the session rather than leave it
        waiting for what that task should have done."""
        if self.closed:
            return
        self.error(errors.SERVER_ERROR, f"internal error ({name}); this session has ended, please reconnect")
        self.close_code = errors.close_code(errors.SERVER_ERROR)
        self.tasks.spawn(self.close("internal_error", self.close_code), "close")

    def slow_consumer_error(self) -> dict[str, Any]:
        return ev.error_event(errors.SLOW_CONSUMER, "the client is not reading server events fast enough; closing")

    def slow_consumer(self) -> None:
        if self.outbound.overflowed:
            self._close_slow(f"outbound queue full ({self.outbound.maxsize})")

    def consumer_stalled(self, why: str) -> None:
        """The transport saw the client stop taking what is sent to it (`why` says how)."""
        self._close_slow(why)

    @property
    def closed_as_slow(self) -> bool:
        return self.close_code == errors.close_code(errors.SLOW_CONSUMER)

    def _close_slow(self, why: str) -> None:
        if self.closed or self.closed_as_slow:
            return
        if self.observer is not None:
            self.observer.error(errors.SLOW_CONSUMER)
        self.close_code = errors.close_code(errors.SLOW_CONSUMER)
        self.log.warning("slow consumer: %s: closing", why)
        self.tasks.spawn(self.close("slow_consumer", self.close_code), "close")
