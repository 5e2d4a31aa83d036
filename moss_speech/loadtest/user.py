"""One simulated user: speaks turns at real time, listens at real time, records each turn.

Transport-neutral: subclasses (client_ws.WsUser, client_webrtc.WebRtcUser) open the connection, send events and
feed received events and audio into `on_event` / `on_audio`. Times are the event loop's monotonic clock.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.results import (
    BAD_EVENT,
    CLIENT_BUG,
    CONNECT_FAILED,
    CONNECTION_CLOSED,
    NO_AUDIO,
    NO_TRANSCRIPT,
    TRANSCRIPTION_FAILED,
    TURN_TIMEOUT,
    Collector,
    TurnRecord,
)
from moss_speech.loadtest.stats import PlaybackBuffer, b64_decoded_len

HANDSHAKE_TIMEOUT_S = 15.0
HANDSHAKE_EVENTS = ("session.created", "session.updated")


class SessionFailed(Exception):
    """The session cannot go on; `code` is counted as an error."""

    def __init__(self, code: str, message: str, counted: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.counted = counted  # already in the collector's error counts


@dataclass
class _Turn:
    rec: TurnRecord
    buf: PlaybackBuffer
    done: asyncio.Event = field(default_factory=asyncio.Event)
    speech_end: float | None = None
    commit_t: float | None = None  # commit sent (commit mode) or input_audio_buffer.committed received (VAD)
    response_id: str | None = None
    first_audio: float | None = None
    last_audio: float | None = None
    first_chunk_samples: int = 0
    done_t: float | None = None
    closed: bool = False
    # WebRTC: the answer is heard on the track, between output_audio_buffer.started and .stopped
    audio_started: bool = False
    audio_stopped: bool = False
    pending_done: tuple[dict[str, Any], float] | None = None
    response_reason: str | None = None  # response.done status_details.reason


def session_update_event(cfg: LoadConfig) -> dict[str, Any]:
    td: dict[str, Any] | None = None
    if cfg.turn_detection == "server_vad":
        td = {"type": "server_vad", "threshold": cfg.vad_threshold, "prefix_padding_ms": 300,
              "silence_duration_ms": cfg.vad_silence_ms, "create_response": True, "interrupt_response": True}
    elif cfg.turn_detection == "semantic_vad":
        td = {"type": "semantic_vad", "eagerness": cfg.eagerness, "create_response": True,
              "interrupt_response": True}
    session: dict[str, Any] = {
        "type": "realtime",
        "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": td},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
    }
    if cfg.transcription:
        session["audio"]["input"]["transcription"] = {"model": "moss-speech"}
    if cfg.max_output_tokens is not None:
        session["max_output_tokens"] = cfg.max_output_tokens
    return {"type": "session.update", "session": session}


def append_message(frame_b64: str) -> str:
    """Pre-serialised append event (users share them; JSON-encoding 50 frames/s/user would cost the client CPU)."""
    return json.dumps({"type": "input_audio_buffer.append", "audio": frame_b64})


class SimulatedUser:
    mic_is_track = False  # True: the transport pulls microphone frames itself (a WebRTC track) at real time

    def __init__(self, cfg: LoadConfig, index: int, speech_msgs: list[str], silence_msg: str, speech_s: float,
                 collector: Collector, run_t0: float, deadline: float) -> None:
        self.cfg = cfg
        self.index = index
        self.speech_msgs = speech_msgs  # serialized append events (ws) or raw frames (webrtc), one per frame
        self.silence_msg = silence_msg
        self.speech_s = speech_s
        self.collector = collector
        self.run_t0 = run_t0
        self.deadline = deadline
        self.loop = asyncio.get_running_loop()
        self.turn: _Turn | None = None
        self._waiters: dict[str, asyncio.Future] = {}
        self._seen: dict[str, dict[str, Any]] = {}  # first handshake events, whenever they arrived
        self._speech_queue: list[str] = []
        self._speech_done: asyncio.Future | None = None
        self._transcribing: dict[str, tuple[TurnRecord, float]] = {}  # committed item id -> its turn, commit time
        self._transcribed = asyncio.Event()  # set whenever no transcript is outstanding
        self.max_lag_s = 0.0
        self.closed_reason: str | None = None
        self._closing = False  # we are closing: the end of the connection is not an error

    # ---- transport hooks -------------------------------------------------------------------------------------
    async def open(self) -> None:
        raise NotImplementedError

    async def send_event(self, evt: dict[str, Any]) -> None:
        raise NotImplementedError

    async def send_mic_frame(self, msg: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def before_commit(self) -> None:
        """Commit mode: wait until the server has the utterance (WebRTC audio trails the data channel)."""

    # ---- lifecycle ------------------------------------------------------------------------------------------
    async def run(self) -> None:
        c = self.collector
        c.sessions_started += 1
        mic: asyncio.Task | None = None
        try:
            try:
                await self.open()
                await self._handshake()
            except SessionFailed:
                raise
            except Exception as e:  # noqa: BLE001 - sockets, HTTP, SDP: whatever stops a session from starting
                raise SessionFailed(CONNECT_FAILED, f"{type(e).__name__}: {e}") from e
            c.sessions_connected += 1
            if self.cfg.vad and not self.mic_is_track:
                mic = asyncio.create_task(self._mic_loop(continuous=True))
            for k in range(self.cfg.turns):
                if self.loop.time() >= self.deadline or not await self._one_turn(k):
                    break
            await self._await_transcripts()
        except SessionFailed as e:
            if not e.counted:
                c.error(e.code, e.message)
        except asyncio.CancelledError:
            self._cut_open_turn()
            raise
        except Exception as e:  # noqa: BLE001 - a bug or an unforeseen failure must show in the report, not vanish
            self._cut_open_turn()
            c.error(CLIENT_BUG, f"{type(e).__name__}: {e}")
        finally:
            self._closing = True
            if mic is not None:
                mic.cancel()
            if self.max_lag_s:
                c.client_lag_ms.append(self.max_lag_s * 1000)
            c.sessions_ended += 1
            try:
                await asyncio.shield(self.close())
            except Exception:  # noqa: BLE001 - closing a broken connection may fail in many ways; nothing to do
                pass

    async def _handshake(self) -> None:
        await self._wait_for("session.created")
        await self.send_event(session_update_event(self.cfg))
        await self._wait_for("session.updated")

    async def _wait_for(self, etype: str) -> dict[str, Any]:
        if etype in self._seen:  # it came before we asked (WebRTC flushes queued events when the channel opens)
            return self._seen[etype]
        fut = self.loop.create_future()
        self._waiters[etype] = fut
        try:
            return await asyncio.wait_for(fut, HANDSHAKE_TIMEOUT_S)
        except TimeoutError as e:
            raise SessionFailed(CONNECT_FAILED, f"no {etype} within {HANDSHAKE_TIMEOUT_S:.0f} s") from e
        finally:
            self._waiters.pop(etype, None)

    def _cut_open_turn(self) -> None:
        t = self.turn
        if t is not None and not t.done.is_set():
            t.rec.status = "cut"
            self.collector.turn(t.rec)
            t.done.set()
        self.turn = None

    # ---- speaking -------------------------------------------------------------------------------------------
    async def _mic_loop(self, continuous: bool) -> None:
        """One frame per frame_ms on an absolute schedule; a frame is sent when it has been 'captured'."""
        frame_s = self.cfg.frame_ms / 1000
        t0 = self.loop.time()
        i = 0
        while True:
            i += 1
            delay = t0 + i * frame_s - self.loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.max_lag_s = max(self.max_lag_s, -delay)
            try:
                if not self._speech_queue and not continuous:
                    return
                await self.send_mic_frame(self.next_mic_frame())
            except Exception as e:  # noqa: BLE001 - any send failure ends this user's microphone
                self.on_closed(f"sending audio failed: {type(e).__name__}: {e}")
                return

    async def _speak(self) -> float:
        """Queue the utterance for the microphone; returns the time its last frame was sent."""
        if self.closed_reason is not None:
            raise SessionFailed(CONNECTION_CLOSED, self.closed_reason, counted=True)
        self._speech_queue = list(reversed(self.speech_msgs))
        self._speech_done = self.loop.create_future()
        if self.cfg.turn_detection == "commit" and not self.mic_is_track:
            await self._mic_loop(continuous=False)
        return await self._speech_done

    def next_mic_frame(self) -> Any:
        """For transports whose track pulls frames: the next utterance frame, or silence."""
        if not self._speech_queue:
            return self.silence_msg
        frame = self._speech_queue.pop()
        if not self._speech_queue and self._speech_done is not None and not self._speech_done.done():
            self._speech_done.set_result(self.loop.time())
        return frame

    # ---- one turn -------------------------------------------------------------------------------------------
    async def _one_turn(self, k: int) -> bool:
        """Returns False when the session cannot take another turn."""
        rec = TurnRecord(session=self.index, turn=k, start_s=self.loop.time() - self.run_t0, speech_s=self.speech_s)
        t = _Turn(rec=rec, buf=PlaybackBuffer(prebuffer_s=self.cfg.prebuffer_ms / 1000))
        self.turn = t
        t.speech_end = await self._speak()
        if self.cfg.turn_detection == "commit":
            await self.before_commit()
            t.commit_t = self.loop.time()
            await self.send_event({"type": "input_audio_buffer.commit"})
            await self.send_event({"type": "response.create"})
        wait = min(self.cfg.turn_timeout_s, self.deadline - self.loop.time())
        try:
            await asyncio.wait_for(t.done.wait(), max(wait, 0.0))
        except TimeoutError:
            if self.loop.time() >= self.deadline:
                self._cut_open_turn()
                return False
            rec.status, rec.error_code = "timeout", TURN_TIMEOUT
            self.collector.error(TURN_TIMEOUT, f"no response.done within {self.cfg.turn_timeout_s} s of speech end")
            self.collector.turn(rec)
            self.turn = None
            return False
        self._finish(t)
        if t.closed:
            return False
        # Listen to the end of the answer before speaking again (speaking earlier would barge in).
        play_end = t.buf.finish(t.done_t or self.loop.time())
        self.turn = None
        await asyncio.sleep(max(0.0, play_end - self.loop.time()) + self.cfg.think_ms / 1000)
        return True

    def _finish(self, t: _Turn) -> None:
        rec = t.rec
        if t.first_audio is not None:
            rec.ttfa_ms = (t.first_audio - (t.speech_end if self.cfg.vad else t.commit_t)) * 1000
            if self.cfg.vad and t.buf.started_at is not None and t.speech_end is not None:
                rec.heard_ms = (t.buf.started_at - t.speech_end) * 1000
            if t.commit_t is not None:
                rec.ttfa_commit_ms = (t.first_audio - t.commit_t) * 1000
            span_samples = t.buf.samples - t.first_chunk_samples
            if span_samples > 0 and t.last_audio is not None:
                rec.rtf = (t.last_audio - t.first_audio) / (span_samples / t.buf.sample_rate)
        if self.cfg.vad and t.commit_t is not None and t.speech_end is not None:
            rec.vad_delay_ms = (t.commit_t - t.speech_end) * 1000
        rec.absorb_playback(t.buf)
        if rec.error_code is None and not t.closed:
            # An answer cut at the length we asked for (--max-output-tokens) is a normal end, not an error.
            cut_by_us = rec.response_status == "incomplete" and t.response_reason == "max_output_tokens"
            if rec.response_status != "completed" and not cut_by_us:
                rec.error_code = f"response_{rec.response_status}"
                self.collector.error(rec.error_code, f"response.done with status {rec.response_status}")
            elif rec.audio_s == 0:
                rec.error_code = NO_AUDIO
                self.collector.error(NO_AUDIO, "response completed without audio")
        rec.status = "ok" if rec.error_code is None else "error"
        self.collector.turn(rec)

    # ---- receiving ------------------------------------------------------------------------------------------
    def on_message(self, raw: str | bytes, now: float) -> None:
        """A raw text message from the server (a JSON event, or garbage that counts as a bad event)."""
        try:
            evt: Any = json.loads(raw)
        except (TypeError, ValueError):
            evt = raw
        self.on_event(evt, now)

    def on_event(self, evt: Any, now: float) -> None:
        if not isinstance(evt, dict) or not isinstance(evt.get("type"), str):
            self.collector.error(BAD_EVENT, f"not an event: {str(evt)[:200]}")
            return
        etype = evt["type"]
        if etype in HANDSHAKE_EVENTS:
            self._seen.setdefault(etype, evt)
        fut = self._waiters.get(etype)
        if fut is not None and not fut.done():
            fut.set_result(evt)
        t = self.turn
        if etype == "error":
            err = evt.get("error") or {}
            code = str(err.get("code") or err.get("type") or "unknown")
            self.collector.error(code, str(err.get("message", "")))
            if t is not None and t.rec.error_code is None:
                t.rec.error_code = code
            for w in self._waiters.values():
                if not w.done():
                    w.set_exception(SessionFailed(code, str(err.get("message", "")), counted=True))
            return
        if etype.startswith("conversation.item.input_audio_transcription."):
            self._on_transcript(etype, evt, now)
            return
        if t is None or t.done.is_set():
            if etype == "response.created":
                self.collector.extra_responses += 1
            return
        if etype == "input_audio_buffer.committed":
            if self.cfg.transcription and isinstance(evt.get("item_id"), str):
                self._transcribing[evt["item_id"]] = (t.rec, now)
            if self.cfg.vad and t.speech_end is not None and t.commit_t is None:
                t.commit_t = now
        elif etype == "response.created":
            # Only the answer to the whole utterance counts: one created while the user is still speaking (the
            # VAD took a pause for the end of the turn) is a false start the user sees; their speech barges in on it.
            if t.response_id is None and t.speech_end is not None:
                t.response_id = (evt.get("response") or {}).get("id")
            else:
                self.collector.extra_responses += 1
                if t.speech_end is None:
                    t.rec.false_starts += 1
        elif etype == "response.output_audio.delta":
            if t.speech_end is None:
                t.rec.talked_over = True  # answer audio while the user is still speaking
            if evt.get("response_id") not in (None, t.response_id):
                return
            try:
                n = b64_decoded_len(evt["delta"]) // 2
            except (KeyError, TypeError, ValueError) as e:
                self.collector.error(BAD_EVENT, f"bad audio delta: {e}")
                return
            self.on_audio(now, n)
        elif etype == "response.done":
            resp = evt.get("response") or {}
            if resp.get("id") not in (None, t.response_id):
                return
            t.rec.response_status = resp.get("status")
            t.response_reason = (resp.get("status_details") or {}).get("reason")
            ttfa = (resp.get("moss") or {}).get("ttfa_ms")
            t.rec.server_ttfa_ms = float(ttfa) if isinstance(ttfa, int | float) else None
            t.done_t = now
            t.done.set()

    async def _await_transcripts(self) -> None:
        """Before hanging up: the transcripts still owed (a turn's usually comes after its answer), each bounded by
        the turn timeout; one that never comes is an error."""
        if self._transcribing:
            self._transcribed.clear()
            wait = min(self.cfg.turn_timeout_s, self.deadline - self.loop.time())
            try:
                await asyncio.wait_for(self._transcribed.wait(), max(wait, 0.0))
            except TimeoutError:
                pass
        for _ in self._transcribing:
            self.collector.error(NO_TRANSCRIPT, "no transcript (.completed or .failed) for a committed turn")
        self._transcribing.clear()

    def _on_transcript(self, etype: str, evt: dict[str, Any], now: float) -> None:
        """A transcript of a committed turn (its `.completed` or `.failed`; deltas are not timed). Transcripts
        often arrive after the turn's answer is done: the record is found by the committed item's id."""
        kind = etype.rsplit(".", 1)[-1]
        if kind not in ("completed", "failed"):
            return
        rec, committed = self._transcribing.pop(str(evt.get("item_id")), (None, 0.0))
        if rec is None:
            return
        if not self._transcribing:
            self._transcribed.set()
        if kind == "completed":
            rec.transcript_ms = (now - committed) * 1000
        else:
            err = evt.get("error") or {}
            self.collector.error(TRANSCRIPTION_FAILED, str(err.get("message", "")))

    def on_audio(self, now: float, n_samples: int) -> None:
        """`n_samples` of answer audio arrived at `now` (24 kHz)."""
        t = self.turn
        if t is None or t.done.is_set() or n_samples <= 0:
            return
        if t.first_audio is None:
            t.first_audio = now
            t.first_chunk_samples = n_samples
        else:
            t.rec.gaps_ms.append((now - t.last_audio) * 1000)
        t.last_audio = now
        t.rec.deltas += 1
        t.buf.on_audio(now, n_samples)

    def on_closed(self, reason: str) -> None:
        """The connection ended or broke."""
        if self.closed_reason is not None or self._closing:
            return
        self.closed_reason = reason
        self.collector.error(CONNECTION_CLOSED, reason)
        if self._speech_done is not None and not self._speech_done.done():
            self._speech_done.set_exception(SessionFailed(CONNECTION_CLOSED, reason, counted=True))
        t = self.turn
        if t is not None and not t.done.is_set():
            if t.rec.error_code is None:
                t.rec.error_code = CONNECTION_CLOSED
            t.closed = True
            t.done_t = self.loop.time()
            t.done.set()
        for w in self._waiters.values():
            if not w.done():
                w.set_exception(SessionFailed(CONNECTION_CLOSED, reason, counted=True))
