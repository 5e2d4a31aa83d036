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

Turn handling: with `server_vad`, silence before speech is only kept as a short prefix ring
(prefix_padding_ms); from speech start the audio streams to the engine, which encodes and prefills it
while the user talks; after silence_duration_ms of silence the turn is committed and (create_response)
an answer is requested. With `turn_detection: null` every append streams to the engine and the client
commits. Engine inputs that arrive while an answer is being generated are held and sent after it ends,
so the engine always sees: answer, (truncate), next user turn.

Barge-in: speech_started while an answer is active (interrupt_response) cancels it, drops queued answer
audio and truncates the engine history to the audio the user heard (track: reported by the transport;
events: samples sent, capped by real time since the first delta, since the client plays at real time).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from engines.protocol import messages as m
from moss_speech.loadtest.stats import PlaybackBuffer
from server.audio.pcm import float32_to_pcm16, pcm16_to_float32
from server.audio.resample import AudioError, Resampler, resample
from server.session import server_events as ev
from server.session.client_events import (
    ProtocolError,
    SessionConfig,
    decode_client_event,
    parse_response_create,
    parse_session_update,
)
from server.session.pacing import AudioOut, Outbound
from server.session.tasks import Background

log = logging.getLogger("server.session.session")

ENGINE_IN_RATE = 16000
ANSWER_RATE = 24000
LISTENER_PREBUFFER_S = 0.06  # the modelled listener's jitter buffer (the load test's and the WebRTC track's default)
CLIENT_RATE = 24000
# User audio goes to the engine in messages of at least this much (96 ms: three VAD windows, more than one speech
# code), and whatever is left before any other engine input. The engine encodes held audio every 80-320 ms anyway,
# so this costs no latency; one message per 32 ms VAD window was ~1,700 messages a second at 108 sessions for the
# engine loop to take between its steps (a third as many now; its host gap did not shrink measurably: PERF_NOTES).
APPEND_MIN_SAMPLES = 1536

AudioOutMode = Literal["events", "track"]


class EngineLink(Protocol):
    """What a Session needs from the engine client (server.engine_client.EngineClient)."""

    ready: bool

    async def send(self, msg: Any) -> None: ...

    def register(self, session_id: str, session: Session) -> None: ...

    def unregister(self, session_id: str) -> None: ...


class SessionObserver(Protocol):
    """Metrics hooks (server.ops.metrics.Metrics implements them); all optional to call."""

    def error(self, code: str) -> None: ...

    def ttfa(self, seconds: float) -> None: ...

    def rtf(self, value: float) -> None: ...

    def underrun(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class SessionLimits:
    max_message_bytes: int = 1 << 20
    max_input_buffer_seconds: float = 60.0
    output_queue_size: int = 512


@dataclass
class _Response:
    id: str
    item_id: str
    modality: str
    created_at: float  # monotonic; TTFA starts at the commit that led here (or here)
    turn_start: float
    metadata: Any = None
    max_output_tokens: int | str = "inf"
    started: bool = False
    prompt_rows: int = 0
    first_audio_at: float | None = None  # monotonic time the first audio left the queue
    audio_samples_queued: int = 0
    played_reported: int | None = None  # track mode: samples played, reported by the transport
    text: list[str] = field(default_factory=list)
    cancel_sent: bool = False
    cancel_reason: str | None = None
    ttfa_ms: float | None = None
    # A listener playing the answer at real time from its first audio on, as the load test models one: a
    # chunk leaving after that listener ran dry is an underrun the server itself caused (network not counted).
    listener: PlaybackBuffer = field(default_factory=lambda: PlaybackBuffer(ANSWER_RATE, LISTENER_PREBUFFER_S))

    @property
    def audio_samples_sent(self) -> int:
        """24 kHz samples of answer audio that have left the queue (the listener has been given them all)."""
        return self.listener.samples


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
        self.config = SessionConfig(model=model)
        if vad_factory is None:  # no server_vad here: clients commit their turns
            self.config = SessionConfig(model=model, turn_detection=None)
        self._vad_factory = vad_factory
        self._vad = None  # created lazily: only server_vad sessions pay for it
        self._observer = observer
        self._on_closed = on_closed
        self.log = logging.LoggerAdapter(log, {"session_id": session_id})
        self._tasks = Background(session_id, self.log, self._background_failed)
        self.outbound = Outbound(self.limits.output_queue_size, overflow_event=self._overflow_error)
        self.closed = False
        self.close_code = 1000
        self._closed_event = asyncio.Event()
        self._started = False
        self._items: list[str] = []  # conversation item ids in order
        self._response: _Response | None = None
        self._last_response: _Response | None = None  # for conversation.item.truncate after it ended
        # Conversation inputs for the engine, in order, held while the engine generates an answer
        # (from CreateResponse sent until its ResponseDone); see _engine_input.
        self._held: deque[Any] = deque()
        self._engine_busy = False
        self._flushing = False
        self._auto_response_pending = False  # a VAD turn ended while a cancelled answer was still finishing
        # Input audio: samples at 16 kHz sent to the engine since the last commit/clear
        self._buffer_samples_16k = 0
        self._unsent_16k: list[np.ndarray] = []  # the part of it not yet sent (< APPEND_MIN_SAMPLES)
        self._buffer_samples_client = 0  # client-rate samples appended since the last commit (limit check)
        # Whether any of it came in `input_audio_buffer.append` events (else only from a track's live mic)
        self._buffer_appended = False
        self._turn_committed_at: float | None = None
        self._input_item_id: str | None = None  # item id of the user turn being spoken (VAD)
        # VAD state (16 kHz)
        self._vad_pending = np.zeros(0, np.float32)  # < one VAD window not yet classified
        self._prefix: deque[np.ndarray] = deque()  # recent silence kept as prefix padding
        self._prefix_samples = 0
        self._in_speech = False
        self._silence_run = 0  # samples of silence since the last speech window
        self._vad_pos = 0  # 16 kHz samples classified by the VAD so far (audio_start_ms / audio_end_ms)
        self._resamplers: dict[int, Resampler] = {}
        self.usage_totals = {"input_rows": 0, "output_rows": 0}

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.engine.register(self.id, self)
        self._started = True
        if self.config.turn_detection is not None:
            await self._ensure_vad()
        await self.engine.send(m.OpenSession(session_id=self.id, instructions=self.config.instructions))
        self._emit(ev.session_event("session.created", self.id, self.config))
        self.log.info("session opened audio_out=%s", self.audio_out)

    async def close(self, reason: str = "client_closed", code: int = 1000) -> None:
        if self.closed:
            return
        self.closed = True
        if self.close_code == 1000:
            self.close_code = code
        r = self._response
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

    @property
    def response_active(self) -> bool:
        return self._response is not None

    # ---- inbound: client events -------------------------------------------------------------

    async def handle_client_text(self, text: str) -> None:
        try:
            event = decode_client_event(text)
        except ProtocolError as e:
            self._error(e.code, e.message)
            return
        await self.handle_client_event(event)

    async def handle_client_event(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        etype = event.get("type")
        client_event_id = event.get("event_id")
        handler = self._HANDLERS.get(etype) if isinstance(etype, str) else None
        if handler is None:
            self._error("unknown_event", f"unknown or unsupported client event type {etype!r}",
                        param="type", event_id=client_event_id)
            return
        try:
            await handler(self, event)
        except ProtocolError as e:
            self._error(e.code, e.message, param=e.param, event_id=client_event_id)
        except Exception as e:  # noqa: BLE001 - a server bug on one event must not end the conversation
            self.log.exception("failed to handle %s", etype)
            self._error("server_error", f"internal error handling {etype}: {type(e).__name__}",
                        event_id=client_event_id, etype="server_error")

    async def feed_audio(self, pcm: np.ndarray, rate: int) -> None:
        """Microphone audio from a track transport: float32 mono in [-1, 1] at `rate` Hz.

        Raises ProtocolError (e.g. `input_audio_buffer_too_large`) for audio the session refuses; the
        transport decides how to report it (an `append` event gets an `error` event instead)."""
        if self.closed:
            return
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        await self._input_audio(pcm, rate, client_samples=int(round(len(pcm) * CLIENT_RATE / rate)))

    def audio_played(self, response_id: str, samples: int) -> None:
        for r in (self._response, self._last_response):
            if r is not None and r.id == response_id:
                r.played_reported = max(r.played_reported or 0, int(samples))

    # -- handlers (each raises ProtocolError for a client mistake; the session survives)

    async def _on_session_update(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id", "session"})
        new = parse_session_update(event.get("session"), self.config)
        if new.turn_detection is not None and self._vad_factory is None:
            raise ProtocolError("server_vad_unavailable", "server_vad is disabled on this server; use "
                                "turn_detection null and input_audio_buffer.commit",
                                "session.audio.input.turn_detection")
        old = self.config
        self.config = new
        if new.turn_detection != old.turn_detection:
            self._reset_vad()
        if (new.instructions, new.voice_prompt_wav) != (old.instructions, old.voice_prompt_wav):
            await self._engine_input(m.UpdateSession(session_id=self.id, instructions=new.instructions,
                                                     voice_wav=new.voice_prompt_wav))
        self._emit(ev.session_event("session.updated", self.id, self.config))

    async def _on_append(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id", "audio"})
        pcm = _decode_pcm16(event.get("audio"), "audio")
        await self._input_audio(pcm, CLIENT_RATE, client_samples=len(pcm))
        self._buffer_appended = True

    async def _on_commit(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id"})
        if not self._uncommitted_samples() and not (self.config.turn_detection and self._prefix_samples):
            raise ProtocolError("input_audio_buffer_commit_empty", "the input audio buffer is empty")
        await self._flush_resamplers()
        if self.config.turn_detection is not None and not self._in_speech:
            await self._flush_prefix_to_engine()
        await self._commit_turn(auto_response=False)

    async def _on_clear(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id"})
        await self._clear_input()

    async def _clear_input(self) -> None:
        self._resamplers.clear()
        sent = self._buffer_samples_16k - sum(len(x) for x in self._unsent_16k)
        self._unsent_16k = []
        if sent:
            await self._engine_input(m.ClearUserAudio(session_id=self.id))
        self._buffer_samples_16k = 0
        self._buffer_samples_client = 0
        self._buffer_appended = False
        self._input_item_id = None
        self._reset_vad()
        self._emit(ev.event("input_audio_buffer.cleared"))

    async def _on_item_create(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id", "previous_item_id", "item"})
        prev = event.get("previous_item_id")
        if prev is not None and prev != (self._items[-1] if self._items else None):
            raise ProtocolError("unsupported_previous_item_id",
                                "items can only be appended at the end of the conversation", "previous_item_id")
        item = event.get("item")
        if not isinstance(item, dict):
            raise ProtocolError("invalid_item", "item must be an object", "item")
        _check_keys(item, {"id", "type", "object", "role", "content", "status"}, "item.")
        if item.get("type", "message") != "message":
            raise ProtocolError("unsupported_item_type", f"item.type {item.get('type')!r} is not supported "
                                "(only 'message')", "item.type")
        role = item.get("role")
        if role not in ("user", "system", "assistant"):
            raise ProtocolError("invalid_item", f"item.role must be user, system or assistant, got {role!r}",
                                "item.role")
        content = item.get("content")
        if not isinstance(content, list) or len(content) != 1 or not isinstance(content[0], dict):
            raise ProtocolError("invalid_item", "item.content must be a list with one content part",
                                "item.content")
        part = content[0]
        item_id = item.get("id") or ev.new_id("item")
        if not isinstance(item_id, str) or len(item_id) > 64 or item_id in self._items:
            raise ProtocolError("invalid_item", "item.id must be a new string of at most 64 characters", "item.id")
        ptype = part.get("type")
        text_types = {"user": "input_text", "system": "input_text", "assistant": "output_text"}
        if ptype in (text_types[role], "text"):
            _check_keys(part, {"type", "text"}, "item.content[0].")
            text = part.get("text")
            if not isinstance(text, str) or not text:
                raise ProtocolError("invalid_item", "text content needs a non-empty string 'text'",
                                    "item.content[0].text")
            msg = m.AddUserText(session_id=self.id, item_id=item_id, text=text, role=role)
            out_part = {"type": text_types[role], "text": text}
        elif ptype == "input_audio" and role == "user":
            _check_keys(part, {"type", "audio", "transcript"}, "item.content[0].")
            try:
                pcm = resample(_decode_pcm16(part.get("audio"), "item.content[0].audio"), CLIENT_RATE,
                               ENGINE_IN_RATE)
            except AudioError as e:
                raise ProtocolError("invalid_audio", str(e), "item.content[0].audio") from None
            await self._settle_uncommitted_audio("adding an audio item")  # after the checks: a bad item clears nothing
            await self._engine_input(m.AppendUserAudio(session_id=self.id, pcm16k=float32_to_pcm16(pcm)))
            msg = m.CommitUserAudio(session_id=self.id, item_id=item_id)
            out_part = {"type": "input_audio", "transcript": part.get("transcript")}
        else:
            raise ProtocolError("unsupported_content_type", f"content type {ptype!r} is not supported for role "
                                f"{role!r}", "item.content[0].type")
        await self._engine_input(msg)
        self._add_item(item_id, role, [out_part])

    async def _on_item_truncate(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id", "item_id", "content_index", "audio_end_ms"})
        item_id = event.get("item_id")
        audio_end_ms = event.get("audio_end_ms")
        r = self._response if self._response and self._response.item_id == item_id else self._last_response
        if r is None or r.item_id != item_id:
            raise ProtocolError("item_truncate_invalid_item_id",
                                "only the latest assistant audio item can be truncated", "item_id")
        if not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise ProtocolError("invalid_value", "audio_end_ms must be an integer >= 0", "audio_end_ms")
        samples = audio_end_ms * ANSWER_RATE // 1000
        if samples > r.audio_samples_queued:
            raise ProtocolError("invalid_value", f"audio_end_ms {audio_end_ms} is beyond the item's audio "
                                f"({r.audio_samples_queued * 1000 // ANSWER_RATE} ms)", "audio_end_ms")
        if r is self._response:
            await self._cancel_response("client_cancelled", samples)
        else:
            await self._engine_input(m.TruncateResponse(session_id=self.id, response_id=r.id,
                                                        audio_samples_played=samples))
        self._emit(ev.event("conversation.item.truncated", item_id=item_id,
                            content_index=event.get("content_index", 0), audio_end_ms=audio_end_ms))

    async def _on_response_create(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id", "response"})
        opts = parse_response_create(event.get("response"), self.config)
        if self._response is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                f"response {self._response.id} is still in progress")
        await self._settle_uncommitted_audio("response.create")
        await self._create_response(opts)

    def _uncommitted_samples(self) -> int:
        """What the input buffer holds for the next commit. Without VAD: what the client appended (client rate; a
        few samples may still sit in the resampler, which a commit flushes). With server_vad: the speech already
        sent to the engine (16 kHz; silence between turns only fills the prefix ring)."""
        return self._buffer_samples_client if self.config.turn_detection is None else self._buffer_samples_16k

    async def _settle_uncommitted_audio(self, before: str) -> None:
        """The engine holds a turn's audio as it arrives, so an answer or an audio item cannot go in before that
        turn is committed or cleared (the engine would fail the answer, or join the item to the open turn).

        Push to talk over a track (WebRTC): the live mic never pauses, and frames still in flight land between a
        client's `input_audio_buffer.clear` and what it sends next; so uncommitted audio that came only from the
        track is cleared here (`input_audio_buffer.cleared` says so) and the request goes ahead. Audio the client
        appended itself, or speech server_vad has not yet ended, is the client's mistake and is refused."""
        held = self._uncommitted_samples()
        if not held:
            return
        if self.config.turn_detection is None and not self._buffer_appended:
            await self._clear_input()
            return
        if self.config.turn_detection is None:
            raise ProtocolError("input_audio_buffer_not_empty",
                                f"the input audio buffer holds {held * 1000 // CLIENT_RATE} ms not yet committed: "
                                f"send input_audio_buffer.commit or input_audio_buffer.clear before {before}")
        raise ProtocolError("input_audio_buffer_not_empty",
                            "the input audio buffer holds speech not yet committed (server_vad commits it when the "
                            "speech stops): wait, or send input_audio_buffer.commit or input_audio_buffer.clear "
                            f"before {before}")

    async def _on_response_cancel(self, event: dict[str, Any]) -> None:
        _check_keys(event, {"type", "event_id", "response_id"})
        rid = event.get("response_id")
        r = self._response
        if r is None or (rid is not None and rid != r.id):
            raise ProtocolError("response_cancel_not_active", "there is no active response to cancel"
                                + (f" with id {rid!r}" if rid else ""))
        await self._cancel_response("client_cancelled", None)

    _HANDLERS: dict[str, Callable[[Session, dict[str, Any]], Any]] = {
        "session.update": _on_session_update,
        "input_audio_buffer.append": _on_append,
        "input_audio_buffer.commit": _on_commit,
        "input_audio_buffer.clear": _on_clear,
        "conversation.item.create": _on_item_create,
        "conversation.item.truncate": _on_item_truncate,
        "response.create": _on_response_create,
        "response.cancel": _on_response_cancel,
    }

    # ---- input audio and turns ---------------------------------------------------------------

    async def _input_audio(self, pcm: np.ndarray, rate: int, client_samples: int) -> None:
        if self.config.turn_detection is not None and not self._in_speech:
            self._buffer_samples_client = 0  # server_vad between turns buffers nothing (a live mic idles here)
        limit = int(self.limits.max_input_buffer_seconds * CLIENT_RATE)
        if self._buffer_samples_client + client_samples > limit:
            raise ProtocolError("input_audio_buffer_too_large",
                                f"the uncommitted input audio would exceed {self.limits.max_input_buffer_seconds:g} s;"
                                " commit or clear it")
        try:
            pcm16k = self._resampler(rate).process(pcm)
        except AudioError as e:
            raise ProtocolError("invalid_audio", str(e)) from None
        self._buffer_samples_client += client_samples
        if self.config.turn_detection is None:
            await self._send_user_audio(pcm16k)
        else:
            await self._vad_feed(pcm16k)

    def _resampler(self, rate: int) -> Resampler:
        # One streaming resampler per input rate, so chunk seams carry no filter edge effects.
        r = self._resamplers.get(rate)
        if r is None:
            r = self._resamplers[rate] = Resampler(rate, ENGINE_IN_RATE)
        return r

    async def _flush_resamplers(self) -> None:
        """Client commit without VAD: the filter's tail belongs to this turn."""
        for rate, r in list(self._resamplers.items()):
            tail = r.flush()
            del self._resamplers[rate]
            if self.config.turn_detection is None:
                await self._send_user_audio(tail)

    async def _send_user_audio(self, pcm16k: np.ndarray) -> None:
        if len(pcm16k) == 0:
            return
        self._buffer_samples_16k += len(pcm16k)
        self._unsent_16k.append(pcm16k)
        if sum(len(x) for x in self._unsent_16k) >= APPEND_MIN_SAMPLES:
            await self._flush_user_audio()

    def _reset_vad(self) -> None:
        self._vad_pending = np.zeros(0, np.float32)
        self._prefix.clear()
        self._prefix_samples = 0
        self._in_speech = False
        self._silence_run = 0
        if self._vad is not None:
            self._vad.reset()

    async def _vad_feed(self, pcm16k: np.ndarray) -> None:
        td = self.config.turn_detection
        assert td is not None
        vad = await self._ensure_vad()
        win = vad.window
        buf = np.concatenate([self._vad_pending, pcm16k]) if len(self._vad_pending) else pcm16k
        n_full = len(buf) // win * win
        self._vad_pending = buf[n_full:].copy()
        if n_full == 0:
            return
        # Classified with every other session's pending windows, in one batched call off the event loop.
        probs = await vad.probs(buf[:n_full].reshape(-1, win))
        for k, start in enumerate(range(0, n_full, win)):
            chunk = buf[start:start + win]
            self._vad_pos += win
            speech = probs[k] >= td.threshold
            if not self._in_speech:
                self._prefix.append(chunk)
                self._prefix_samples += len(chunk)
                keep = td.prefix_padding_ms * ENGINE_IN_RATE // 1000 + win
                while self._prefix and self._prefix_samples - len(self._prefix[0]) >= keep:
                    self._prefix_samples -= len(self._prefix.popleft())
                if speech:
                    await self._speech_started()
            else:
                self._silence_run = 0 if speech else self._silence_run + len(chunk)
                await self._send_user_audio(chunk)
                if self._silence_run * 1000 >= td.silence_duration_ms * ENGINE_IN_RATE:
                    await self._speech_stopped()
            if self.closed:
                return

    async def _ensure_vad(self) -> Any:
        if self._vad is None:
            if self._vad_factory is None:
                raise ProtocolError("server_vad_unavailable", "server_vad is not available on this server")
            vad = await asyncio.to_thread(self._vad_factory)  # the first one imports torch
            await vad.ready()  # the shared model loads once per process (tens of ms), not on a turn
            if self._vad is None:
                self._vad = vad
        return self._vad

    async def _flush_prefix_to_engine(self) -> None:
        if self._prefix:
            pcm = np.concatenate(list(self._prefix))
            self._prefix.clear()
            self._prefix_samples = 0
            await self._send_user_audio(pcm)

    async def _speech_started(self) -> None:
        self._in_speech = True
        self._silence_run = 0
        td = self.config.turn_detection
        if self._response is not None and td is not None and td.interrupt_response:
            await self._cancel_response("turn_detected", self._played_samples(self._response))
        # The prefix ring holds up to prefix_padding_ms before the window that triggered, and that window:
        # the turn's audio (and audio_start_ms, as in the GA API) begins where the ring begins.
        start_ms = (self._vad_pos - self._prefix_samples) * 1000 // ENGINE_IN_RATE
        await self._flush_prefix_to_engine()
        self._input_item_id = ev.new_id("item")
        self._emit(ev.event("input_audio_buffer.speech_started", audio_start_ms=start_ms,
                            item_id=self._input_item_id))

    async def _speech_stopped(self) -> None:
        td = self.config.turn_detection
        assert td is not None
        await self._flush_user_audio()  # the turn's last audio (the silence run that ends it)
        self._in_speech = False
        self._silence_run = 0
        # The end of the audio sent for the turn, trailing silence included (GA semantics).
        end_ms = self._vad_pos * 1000 // ENGINE_IN_RATE
        self._emit(ev.event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=self._input_item_id))
        await self._commit_turn(auto_response=td.create_response)

    async def _commit_turn(self, auto_response: bool) -> None:
        item_id = self._input_item_id or ev.new_id("item")
        self._input_item_id = None
        self._in_speech = False
        prev = self._items[-1] if self._items else None
        await self._engine_input(m.CommitUserAudio(session_id=self.id, item_id=item_id))
        self._buffer_samples_16k = 0
        self._buffer_samples_client = 0
        self._buffer_appended = False
        self._turn_committed_at = time.monotonic()
        self._emit(ev.event("input_audio_buffer.committed", previous_item_id=prev, item_id=item_id))
        self._add_item(item_id, "user", [{"type": "input_audio", "transcript": None}])
        if auto_response:
            if self._response is None:
                await self._create_response(parse_response_create(None, self.config))
            elif self._response.cancel_sent:  # barge-in: answer once the interrupted one has ended
                self._auto_response_pending = True

    def _add_item(self, item_id: str, role: str, content: list[dict[str, Any]]) -> None:
        prev = self._items[-1] if self._items else None
        self._items.append(item_id)
        item = ev.item(item_id, role, content, status="completed")
        self._emit(ev.event("conversation.item.added", previous_item_id=prev, item=item))
        self._emit(ev.event("conversation.item.done", previous_item_id=prev, item=item))

    # ---- responses ---------------------------------------------------------------------------

    async def _create_response(self, opts: dict[str, Any]) -> None:
        now = time.monotonic()
        r = _Response(id=ev.new_id("resp"), item_id=ev.new_id("item"), modality=opts["modality"], created_at=now,
                      turn_start=self._turn_committed_at or now, metadata=opts.get("metadata"),
                      max_output_tokens=opts["max_output_tokens"])
        self._turn_committed_at = None
        self._response = r
        sampling = opts["sampling"]
        self._emit(ev.event("response.created", response=ev.response_obj(r, self.id, "in_progress")))
        await self._engine_input(m.CreateResponse(session_id=self.id, response_id=r.id, modality=r.modality,
                                                  sampling=sampling))
        self.log.info("response created id=%s modality=%s", r.id, r.modality)

    async def _cancel_response(self, reason: str, played_samples: int | None) -> None:
        r = self._response
        if r is None or r.cancel_sent:
            return
        r.cancel_sent = True
        r.cancel_reason = reason
        if self._unsend_create(r.id):  # the engine never saw it: end it here
            self._finish_response(r, "cancelled", reason)
            return
        await self.engine.send(m.CancelResponse(session_id=self.id, response_id=r.id))
        if played_samples is not None:
            dropped = self.outbound.drop_audio(r.id)
            r.audio_samples_queued -= dropped
            await self.engine.send(m.TruncateResponse(session_id=self.id, response_id=r.id,
                                                      audio_samples_played=int(played_samples)))
        self.log.info("response cancel id=%s reason=%s played=%s", r.id, reason, played_samples)

    def _played_samples(self, r: _Response) -> int:
        if r.played_reported is not None:
            return min(r.played_reported, r.audio_samples_sent)
        if r.first_audio_at is None:
            return 0
        by_clock = int((time.monotonic() - r.first_audio_at) * ANSWER_RATE)
        return min(r.audio_samples_sent, by_clock)

    def _audio_taken(self, r: _Response, samples: int) -> None:
        now = time.monotonic()
        if r.first_audio_at is None:
            r.first_audio_at = now
            r.ttfa_ms = (r.first_audio_at - r.turn_start) * 1000.0
            if self._observer is not None:
                self._observer.ttfa(r.ttfa_ms / 1000.0)
        heard, silent_s = r.listener.underruns, r.listener.stall_s
        r.listener.on_audio(now, samples)
        if r.listener.underruns > heard and self._observer is not None:
            self._observer.underrun(r.listener.stall_s - silent_s)

    # ---- engine messages ---------------------------------------------------------------------

    def on_engine_message(self, msg: Any) -> None:
        if self.closed:
            return
        r = self._response
        rid = getattr(msg, "response_id", None)
        if isinstance(msg, m.Error):
            self._error(msg.code, msg.message, etype="server_error")
            if r is not None and rid == r.id:
                self._finish_response(r, "failed", msg.code, error={"type": "server_error", "code": msg.code,
                                                                  "message": msg.message})
            return
        if r is None or rid != r.id:
            return  # SessionReady, UserAudioProgress, or late output of a finished response
        if isinstance(msg, m.ResponseStarted):
            r.started = True
            r.prompt_rows = msg.prompt_rows
            part = {"type": "output_audio" if r.modality == "audio" else "output_text",
                    **({"transcript": ""} if r.modality == "audio" else {"text": ""})}
            self._emit(ev.event("response.output_item.added", response_id=r.id, output_index=0,
                                item=ev.item(r.item_id, "assistant", [], status="in_progress")))
            prev = self._items[-1] if self._items else None
            self._items.append(r.item_id)
            self._emit(ev.event("conversation.item.added", previous_item_id=prev,
                                item=ev.item(r.item_id, "assistant", [], status="in_progress")))
            self._emit(ev.event("response.content_part.added", response_id=r.id, item_id=r.item_id,
                                output_index=0, content_index=0, part=part))
        elif isinstance(msg, m.TextDelta):
            if not msg.text or r.cancel_sent:
                return
            r.text.append(msg.text)
            etype = "response.output_audio_transcript.delta" if r.modality == "audio" else "response.output_text.delta"
            self._emit(ev.event(etype, response_id=r.id, item_id=r.item_id, output_index=0, content_index=0,
                                delta=msg.text))
        elif isinstance(msg, m.AudioChunk):
            if r.cancel_sent or r.modality != "audio" or not msg.pcm24k:
                return
            samples = len(msg.pcm24k) // 2
            r.audio_samples_queued += samples
            if self.audio_out == "track":
                item: Any = AudioOut(r.id, r.item_id, msg.pcm24k, msg.index)
            else:
                item = ev.event("response.output_audio.delta", response_id=r.id, item_id=r.item_id, output_index=0,
                                content_index=0, delta=base64.b64encode(msg.pcm24k).decode("ascii"))
            if not self.outbound.put(item, response_id=r.id, samples=samples,
                                     on_taken=lambda: self._audio_taken(r, samples)):
                self._slow_consumer()
        elif isinstance(msg, m.ResponseDone):
            status = msg.status
            reason = msg.reason
            if r.cancel_sent and status == "completed":
                status = "cancelled"
            if status == "cancelled":
                reason = r.cancel_reason or reason or "client_cancelled"
            self._finish_response(r, status, reason, done=msg)

    def on_engine_lost(self) -> None:
        """The engine process died: the history is gone, so this conversation ends with an error."""
        if self.closed:
            return
        r = self._response
        if r is not None:
            self._finish_response(r, "failed", "engine_unavailable",
                                  error={"type": "server_error", "code": "engine_unavailable",
                                         "message": "the engine process stopped"})
        self._error("engine_unavailable", "the engine process stopped; this session has ended, please reconnect",
                    etype="server_error")
        self.close_code = 1011
        self._started = False  # nothing to close on the (new) engine
        self._tasks.spawn(self.close("engine_lost", 1011), "close")

    def _finish_response(self, r: _Response, status: str, reason: str | None, *, done: m.ResponseDone | None = None,
                         error: dict[str, Any] | None = None) -> None:
        text = "".join(r.text)
        if r.started:
            base = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
            if r.modality == "audio":
                part = {"type": "output_audio", "transcript": text}
                self._emit(ev.event("response.output_audio.done", **base))
                self._emit(ev.event("response.output_audio_transcript.done", transcript=text, **base))
            else:
                part = {"type": "output_text", "text": text}
                self._emit(ev.event("response.output_text.done", text=text, **base))
            self._emit(ev.event("response.content_part.done", part=part, **base))
            item_status = "completed" if status == "completed" else "incomplete"
            item = ev.item(r.item_id, "assistant", [part], status=item_status)
            self._emit(ev.event("response.output_item.done", response_id=r.id, output_index=0, item=item))
            self._emit(ev.event("conversation.item.done", previous_item_id=self._prev_of(r.item_id), item=item))
            output = [item]
        else:
            output = []
        usage = ev.usage(done, r.modality) if done is not None else None
        if done is not None:
            self.usage_totals["input_rows"] += done.prompt_rows
            self.usage_totals["output_rows"] += done.output_rows
        details = None
        if status != "completed":
            details = {"type": status, "reason": reason}
            if error is not None:
                details["error"] = error
        resp = ev.response_obj(r, self.id, status, output=output, usage=usage, status_details=details)
        audio_samples = done.audio_samples if done is not None else 0

        def sent() -> None:
            # Queued behind the answer's audio: by now the first audio has left, so TTFA is known.
            resp["ttfa_ms"] = None if r.ttfa_ms is None else round(r.ttfa_ms, 2)
            if self._observer is not None and r.first_audio_at is not None and audio_samples:
                self._observer.rtf((time.monotonic() - r.first_audio_at) / (audio_samples / ANSWER_RATE))
            self.log.info("response done id=%s status=%s reason=%s ttfa_ms=%s", r.id, status, reason,
                          resp["ttfa_ms"])

        self._emit(ev.event("response.done", response=resp), on_taken=sent)
        self._last_response = r
        self._response = None
        self._engine_busy = False
        if self._held:
            self._tasks.spawn(self._flush_held(), "flush-held")
        if self._auto_response_pending:
            self._auto_response_pending = False
            self._tasks.spawn(self._auto_response(), "auto-response")

    async def _auto_response(self) -> None:
        # A response.create handled since the interrupted answer ended already answers the turn; a second
        # answer created over it would leave it running unseen (its output and end ignored, inputs held).
        if self._response is None and not self.closed:
            await self._create_response(parse_response_create(None, self.config))

    def _prev_of(self, item_id: str) -> str | None:
        i = self._items.index(item_id) if item_id in self._items else 0
        return self._items[i - 1] if i > 0 else None

    # ---- outbound helpers --------------------------------------------------------------------

    async def _engine_input(self, msg: Any) -> None:
        """Conversation input (user audio, items, CreateResponse) for the engine, strictly in order; held
        from a CreateResponse until its answer has ended (see module doc). User audio not yet sent goes first."""
        await self._flush_user_audio()
        await self._send_or_hold(msg)

    async def _flush_user_audio(self) -> None:
        if self._unsent_16k:
            pcm = np.concatenate(self._unsent_16k) if len(self._unsent_16k) > 1 else self._unsent_16k[0]
            self._unsent_16k = []
            await self._send_or_hold(m.AppendUserAudio(session_id=self.id, pcm16k=float32_to_pcm16(pcm)))

    async def _send_or_hold(self, msg: Any) -> None:
        if self._engine_busy or self._held or self._flushing:
            self._held.append(msg)
        else:
            await self._send_ordered(msg)

    async def _send_ordered(self, msg: Any) -> None:
        if isinstance(msg, m.CreateResponse):
            self._engine_busy = True
        await self.engine.send(msg)

    async def _flush_held(self) -> None:
        if self._flushing:
            return
        self._flushing = True
        try:
            while self._held and not self._engine_busy and not self.closed:
                await self._send_ordered(self._held.popleft())
        finally:
            self._flushing = False

    def _unsend_create(self, response_id: str) -> bool:
        for msg in self._held:
            if isinstance(msg, m.CreateResponse) and msg.response_id == response_id:
                self._held.remove(msg)
                return True
        return False

    def _emit(self, event: dict[str, Any], on_taken: Callable[[], None] | None = None) -> None:
        if not self.outbound.put(event, on_taken=on_taken):
            self._slow_consumer()

    def _error(self, code: str, message: str, *, param: str | None = None, event_id: Any = None,
               etype: str = "invalid_request_error") -> None:
        if self._observer is not None:
            self._observer.error(code)
        self.log.info("error code=%s message=%s", code, message)
        self._emit(ev.error_event(code, message, param=param, event_id=event_id, etype=etype))

    def _background_failed(self, name: str) -> None:
        """A task this session started failed (logged by Background): end the session rather than leave it
        waiting for what that task should have done."""
        if self.closed:
            return
        self._error("server_error", f"internal error ({name}); this session has ended, please reconnect",
                    etype="server_error")
        self.close_code = 1011
        self._tasks.spawn(self.close("internal_error", 1011), "close")

    def _overflow_error(self) -> dict[str, Any]:
        return ev.error_event("slow_consumer", "the client is not reading server events fast enough; closing",
                              etype="server_error")

    def _slow_consumer(self) -> None:
        if self.closed or not self.outbound.overflowed or self.close_code == 1008:
            return
        if self._observer is not None:
            self._observer.error("slow_consumer")
        self.close_code = 1008
        self.log.warning("outbound queue full (%d): closing", self.outbound.maxsize)
        self._tasks.spawn(self.close("slow_consumer", 1008), "close")


def _check_keys(d: dict[str, Any], allowed: set[str], prefix: str = "") -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ProtocolError("unknown_parameter", "unknown or unsupported field(s): "
                            + ", ".join(prefix + k for k in unknown), prefix + unknown[0])


def _decode_pcm16(data: Any, param: str) -> np.ndarray:
    """base64 PCM16 LE -> float32 [n] in [-1, 1)."""
    if not isinstance(data, str):
        raise ProtocolError("invalid_audio", "audio must be a base64 string of PCM16 little-endian samples", param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_audio", "audio is not valid base64", param) from None
    if len(raw) % 2:
        raise ProtocolError("invalid_audio", "audio has an odd number of bytes (PCM16 needs 2 per sample)", param)
    return pcm16_to_float32(raw)
