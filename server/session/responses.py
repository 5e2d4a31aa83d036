"""A session's answers: creating one, the engine's output turned into server events, cancelling one (barge-in
truncates the engine's history to the audio the user heard), and its end (`response.done`)."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engines.protocol import errors
from engines.protocol import messages as m
from server.audio.formats import PCM, AnswerEncoder
from server.audio.stretch import Stretch
from server.session import server_events as ev
from server.session.client_events import parse_response_create
from server.session.pacing import ANSWER_RATE, AudioOut, Playback

if TYPE_CHECKING:
    from server.session.session import Session


@dataclass
class Response:
    id: str
    item_id: str
    modality: str
    created_at: float  # monotonic
    playback: Playback
    metadata: Any = None
    max_output_tokens: int | str = "inf"
    started: bool = False
    prompt_rows: int = 0
    audio_samples_queued: int = 0
    text: list[str] = field(default_factory=list)
    cancel_sent: bool = False
    cancel_reason: str | None = None
    stopped_by_server_limit: bool = False  # the client set no limit ("inf"); the server's max_answer_rows ended it
    cut_at: int | None = None  # 24 kHz samples the engine's history keeps after a truncation (None: all of it)
    # An item at or before it left the conversation (deleted, or dropped to fit the context): the engine prefills
    # its rows again and it can no longer be cut short. So too an out-of-band answer, whose rows leave the history.
    moved: bool = False
    out_of_band: bool = False  # `conversation: "none"`: no conversation item
    # Its audio in the format of its response.output_audio.delta events (what the engine makes is 24 kHz PCM16)
    encoder: AnswerEncoder = field(default_factory=lambda: AnswerEncoder(PCM, ANSWER_RATE))
    # It has instructions of its own: the engine has them as a system turn before it, and is given the session's
    # again as another after it.
    instructed: bool = False
    # Played at a speed other than 1: the samples this server counts (queued, played, kept) are the listener's, the
    # engine's are `model_samples` of them.
    stretch: Stretch | None = None

    def model_samples(self, heard: int) -> int:
        """The model's samples under `heard` samples of the answer as played (to the stretch's ~20 ms)."""
        return heard if self.stretch is None else round(heard * self.stretch.speed)

    @property
    def kept_samples(self) -> int:
        """The answer's audio the engine's history holds."""
        return self.audio_samples_queued if self.cut_at is None else min(self.cut_at, self.audio_samples_queued)

    @kept_samples.setter
    def kept_samples(self, samples: int) -> None:
        self.cut_at = samples
    output_rows: int = 0  # from its ResponseDone
    input_rows: int = 0  # from its ResponseDone: its prefilled rows, counted in the session's usage_totals

    @property
    def ttfa_ms(self) -> float | None:
        return self.playback.ttfa_ms


class Responses:
    def __init__(self, session: Session) -> None:
        self.s = session
        self.active: Response | None = None
        self.last: Response | None = None  # for conversation.item.truncate after it ended
        self.turn_committed_at: float | None = None  # the user turn the next answer answers (TTFA starts there)
        self._auto_response_pending = False  # a VAD turn ended while a cancelled answer was still finishing
        self._withdrawn: str | None = None  # a withdrawn answer whose ResponseDone the engine still owes

    def audio_played(self, response_id: str, samples: int) -> None:
        for r in (self.active, self.last):
            if r is not None and r.id == response_id:
                r.playback.report_played(samples)

    async def create(self, opts: dict[str, Any]) -> None:
        s = self.s
        now = time.monotonic()
        r = Response(id=ev.new_id("resp"), item_id=ev.new_id("item"), modality=opts["modality"], created_at=now,
                     playback=Playback(turn_start=self.turn_committed_at or now), metadata=opts.get("metadata"),
                     max_output_tokens=opts["max_output_tokens"], encoder=AnswerEncoder(opts["format"], ANSWER_RATE),
                     stretch=Stretch(s.config.speed, ANSWER_RATE) if s.config.speed != 1 else None,
                     out_of_band=opts.get("out_of_band", False), moved=opts.get("out_of_band", False))
        self.turn_committed_at = None
        self.active = r
        s.idle.disarm()
        sampling = opts["sampling"]
        s.emit(ev.event("response.created", response=ev.response_obj(r, s.id, "in_progress")))
        own = opts.get("instructions")
        if own is not None and not r.out_of_band:  # they stay in the conversation, and the session's follow them
            r.instructed = True
            await s.engine_inputs.send(m.UpdateSession(session_id=s.id, instructions=own, pinned=False))
        await s.engine_inputs.send(m.CreateResponse(
            session_id=s.id, response_id=r.id, modality=r.modality, sampling=sampling, item_id=r.item_id,
            out_of_band=r.out_of_band, instructions=own if r.out_of_band else None))
        s.log.info("response created id=%s modality=%s", r.id, r.modality)

    async def turn_ended(self) -> None:
        """A VAD turn ended and asks for an answer (create_response)."""
        if self.active is None:
            await self.create(parse_response_create(None, self.s.config))
        elif self.active.cancel_sent:  # barge-in: answer once the interrupted one has ended
            self._auto_response_pending = True

    async def user_started_speaking(self, interrupt: bool) -> None:
        """server_vad heard speech start. Barge-in (`interrupt`): the answer is cancelled, or, when it has ended but
        its audio still plays on a track, cut where the listener is. On a track the server knows how much was heard
        and says where it truncated (`conversation.item.truncated`, as OpenAI's WebRTC server does); over the
        WebSocket only the client knows, and it sends `conversation.item.truncate` itself."""
        s = self.s
        s.idle.disarm()
        if not interrupt:
            return
        r = self.active
        if r is not None:
            played = r.playback.played()
            await self.cancel("turn_detected", played)
        else:
            r = self.last
            if r is None or r.playback.played_reported is None:
                return
            played = r.playback.played()
            if played >= r.kept_samples or not await self.stop_heard(r, played):
                return  # heard to the end (or cut there already), or it stays whole in the history
        if s.audio_out == "track" and r.started and not r.out_of_band:
            s.emit(ev.event("conversation.item.truncated", item_id=r.item_id, content_index=0,
                            audio_end_ms=played * 1000 // ANSWER_RATE))

    async def stop_heard(self, r: Response, played: int) -> bool:
        """An answer (cancelled, or ended) stops where its listener is: its queued audio is dropped and the engine's
        history cut there, unless its rows moved (then the conversation keeps it whole; only an ended answer's can).
        True if the history was cut."""
        s = self.s
        r.audio_samples_queued -= s.outbound.drop_audio(r.id)
        if r.moved:
            return False
        await s.engine.send(m.TruncateResponse(session_id=s.id, response_id=r.id,
                                               audio_samples_played=r.model_samples(played)))
        r.kept_samples = played
        return True

    async def cancel(self, reason: str, played_samples: int | None) -> None:
        s = self.s
        r = self.active
        if r is None or r.cancel_sent:
            return
        r.cancel_sent = True
        r.cancel_reason = reason
        # The engine never saw it: it ends here (the session's instructions going in where it would have been)
        if s.engine_inputs.unsend_create(r.id, instead=self._instructions_back(r)):
            r.instructed = False
            self.finish(r, "cancelled", reason)
            return
        await s.engine.send(m.CancelResponse(session_id=s.id, response_id=r.id))
        if played_samples is not None:
            await self.stop_heard(r, int(played_samples))
        s.log.info("response cancel id=%s reason=%s played=%s", r.id, reason, played_samples)

    async def withdraw(self, response_id: str, last: Response | None) -> None:
        """The answer to a tentative commit goes, unseen (its events were held: turn_detection.py); the engine
        rolls it back. `last`: the answer before it (conversation.item.truncate's)."""
        s = self.s
        r = self.active
        if r is not None and r.id == response_id:
            self.active = None
            self._withdrawn = response_id  # its output and ResponseDone still come; the held inputs wait for that
        elif self.last is not None and self.last.id == response_id:  # it had ended already, unseen
            s.usage_totals["input_rows"] -= self.last.input_rows
            s.usage_totals["output_rows"] -= self.last.output_rows
            if s.observer is not None:
                s.observer.speculation(withdrawn=True, wasted_rows=self.last.output_rows)
        self.last = last
        await s.engine.send(m.WithdrawResponse(session_id=s.id, response_id=response_id))

    def on_engine_message(self, msg: Any) -> None:
        s = self.s
        r = self.active
        rid = getattr(msg, "response_id", None)
        if rid is not None and rid == self._withdrawn:
            if isinstance(msg, m.ResponseDone):
                self._withdrawn = None
                s.engine_inputs.answer_ended()
                if s.observer is not None:
                    s.observer.speculation(withdrawn=True, wasted_rows=msg.output_rows)
            return
        if isinstance(msg, m.Error):
            s.error(msg.code, msg.message)
            if r is not None and rid == r.id:
                self.fail(r, msg.code, msg.message)
            return
        if r is None or rid != r.id:
            return  # SessionReady, UserAudioProgress, or late output of a finished response
        if isinstance(msg, m.ResponseStarted):
            r.started = True
            r.prompt_rows = msg.prompt_rows
            # content_part events name the part "audio" / "text" (the item's content says output_audio / output_text)
            part = {"type": r.modality, **({"transcript": ""} if r.modality == "audio" else {"text": ""})}
            s.emit(ev.event("response.output_item.added", response_id=r.id, output_index=0,
                            item=ev.item(r.item_id, "assistant", [], status="in_progress")))
            if not r.out_of_band:
                prev = s.items[-1] if s.items else None
                s.items.append(r.item_id)
                s.emit(ev.event("conversation.item.added", previous_item_id=prev,
                                item=ev.item(r.item_id, "assistant", [], status="in_progress")))
            s.emit(ev.event("response.content_part.added", response_id=r.id, item_id=r.item_id,
                            output_index=0, content_index=0, part=part))
        elif isinstance(msg, m.TextDelta):
            if not msg.text or r.cancel_sent:
                return
            r.text.append(msg.text)
            etype = "response.output_audio_transcript.delta" if r.modality == "audio" else "response.output_text.delta"
            s.emit(ev.event(etype, response_id=r.id, item_id=r.item_id, output_index=0, content_index=0,
                            delta=msg.text))
        elif isinstance(msg, m.AudioChunk):
            if r.cancel_sent or r.modality != "audio" or not msg.pcm24k:
                return
            self._audio(r, msg.pcm24k if r.stretch is None else r.stretch.process(msg.pcm24k), msg.index)
        elif isinstance(msg, m.ResponseDone):
            status = msg.status
            reason = msg.reason
            if r.cancel_sent and status == "completed":
                status = "cancelled"
            if status == "cancelled":
                reason = r.cancel_reason or reason or "client_cancelled"
            if status == "incomplete" and reason == "max_output_tokens" and r.max_output_tokens == "inf":
                status, reason, r.stopped_by_server_limit = "completed", None, True
            self.finish(r, status, reason, done=msg)

    def _instructions_back(self, r: Response) -> m.UpdateSession | None:
        """After an answer with instructions of its own: the session's instructions again (none: the default prompt
        of the answer's modality)."""
        if not r.instructed:
            return None
        c = self.s.config
        return m.UpdateSession(session_id=self.s.id, instructions=c.instructions, pinned=False,
                               default_instructions=r.modality if c.instructions is None else None)

    @staticmethod
    def _delta(r: Response, audio: bytes) -> dict[str, Any]:
        return ev.event("response.output_audio.delta", response_id=r.id, item_id=r.item_id, output_index=0,
                        content_index=0, delta=base64.b64encode(audio).decode("ascii"))

    def _audio(self, r: Response, pcm: bytes, index: int) -> None:
        """Answer audio as its listener will hear it (24 kHz PCM16, at the response's speed), to the client."""
        if not pcm:
            return
        samples = len(pcm) // 2
        r.audio_samples_queued += samples
        if self.s.audio_out == "track":
            self._queue_audio(r, AudioOut(r.id, r.item_id, pcm, index), samples)
        else:
            self._queue_audio(r, self._delta(r, r.encoder.encode(pcm)), samples)

    def _queue_audio(self, r: Response, item: Any, samples: int) -> None:
        """`samples`: 24 kHz samples of the answer the item carries (what pacing and truncation count)."""
        s = self.s
        if not s.outbound.put(item, response_id=r.id, samples=samples,
                              on_taken=lambda: r.playback.taken(samples, s.observer)):
            s.slow_consumer()

    def fail(self, r: Response, code: str, message: str) -> None:
        """The answer ends `failed`, its status details carrying the error (engines.protocol.errors `code`)."""
        self.finish(r, "failed", code, error={"type": errors.error_type(code), "code": code, "message": message})

    def finish(self, r: Response, status: str, reason: str | None, *, done: m.ResponseDone | None = None,
               error: dict[str, Any] | None = None) -> None:
        s = self.s
        text = "".join(r.text)
        if r.started:
            base = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
            if r.modality == "audio":
                part = {"type": "output_audio", "transcript": text}
                if r.stretch is not None and not r.cancel_sent:
                    self._audio(r, r.stretch.flush(), -1)  # what the stretch held back
                tail = b"" if r.cancel_sent or s.audio_out == "track" else r.encoder.flush()
                if tail:  # the resampler's last samples (its delay), in the answer's last delta
                    self._queue_audio(r, self._delta(r, tail), 0)
                s.emit(ev.event("response.output_audio.done", **base))
                s.emit(ev.event("response.output_audio_transcript.done", transcript=text, **base))
            else:
                part = {"type": "output_text", "text": text}
                s.emit(ev.event("response.output_text.done", text=text, **base))
            s.emit(ev.event("response.content_part.done", part={**part, "type": r.modality}, **base))
            item_status = "completed" if status == "completed" else "incomplete"
            item = ev.item(r.item_id, "assistant", [part], status=item_status)
            s.emit(ev.event("response.output_item.done", response_id=r.id, output_index=0, item=item))
            if not r.out_of_band:
                s.emit(ev.event("conversation.item.done", previous_item_id=s.prev_of(r.item_id), item=item))
                s.item_objs[r.item_id] = item
                s.item_audio_samples[r.item_id] = r.audio_samples_queued
            output = [item]
        else:
            output = []
        if done is not None:
            r.output_rows, r.input_rows = done.output_rows, done.prompt_rows
            s.usage_totals["input_rows"] += done.prompt_rows
            s.usage_totals["output_rows"] += done.output_rows
        details = None
        if status != "completed":
            details = {"type": status, "reason": reason}
            if error is not None:
                details["error"] = error
        resp = ev.response_obj(r, s.id, status, output=output, done=done, status_details=details)
        audio_samples = 0 if done is None else done.audio_samples if r.stretch is None else round(
            done.audio_samples / r.stretch.speed)  # the answer's length as played

        def sent() -> None:
            # Queued behind the answer's audio: by now the first audio has left, so TTFA is known.
            resp["moss"]["ttfa_ms"] = None if r.ttfa_ms is None else round(r.ttfa_ms, 2)
            first_audio_at = r.playback.first_audio_at
            if s.observer is not None and first_audio_at is not None and audio_samples:
                s.observer.rtf((time.monotonic() - first_audio_at) / (audio_samples / ANSWER_RATE))
            s.log.info("response done id=%s status=%s reason=%s ttfa_ms=%s", r.id, status, reason,
                       resp["moss"]["ttfa_ms"])

        s.emit(ev.event("response.done", response=resp), on_taken=sent)
        self.last = r
        self.active = None
        s.engine_inputs.answer_ended(first=self._instructions_back(r))  # (before what the client sent meanwhile)
        first = r.playback.first_audio_at
        heard_at = (first if first is not None else time.monotonic()) + r.audio_samples_queued / ANSWER_RATE
        s.idle.arm(heard_at - time.monotonic())
        if self._auto_response_pending:
            self._auto_response_pending = False
            s.tasks.spawn(self._auto_response(), "auto-response")

    async def _auto_response(self) -> None:
        # A response.create handled since the interrupted answer ended already answers the turn; a second
        # answer created over it would leave it running unseen (its output and end ignored, inputs held).
        if self.active is None and not self.s.closed:
            await self.create(parse_response_create(None, self.s.config))
