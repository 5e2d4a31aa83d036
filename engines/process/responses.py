"""The answer's side of a turn in the engine service: CreateResponse (its rows appended to the open user turn, or a
new engine request), CancelResponse and TruncateResponse, and what happens when the engine finishes a request: the
answer kept (cut to what the user heard), an undone turn put back, ResponseDone once the answer's last audio is out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from engines.api import ChannelSampling, EngineError, SamplingParams, StepOutput
from engines.process.codec_worker import CodecWorker
from engines.process.errors import ServiceError
from engines.process.limits import InputLimits
from engines.process.prompt import PromptBuilder
from engines.process.sessions import Answer, ResponseState, Session, Turn
from engines.process.tokenizer import IncrementalDetokenizer, TextTokenizer
from engines.protocol import errors
from engines.protocol import messages as m
from engines.tokens import Row

log = logging.getLogger("engines.process")


def sampling_params(s: m.Sampling) -> SamplingParams:
    """One setting for both channels; invalid values raise ConfigError."""
    ch = ChannelSampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                         repetition_penalty=s.repetition_penalty)
    return SamplingParams(text=ch, audio=ch, greedy=s.greedy, min_new_tokens=s.min_new_tokens,
                          max_new_tokens=s.max_new_tokens, seed=s.seed)


class Responses:
    """Part of Service (service.py): the answers of turns. Calls Service's _session and _release, UserInput's _pump
    and _system_rows (user_input.py), and Outputs' _send and _text (outputs.py)."""

    engine: Any
    tokenizer: TextTokenizer
    prompts: PromptBuilder
    decoder: Any
    sessions: dict[str, Session]
    _requests: dict[str, tuple[Session, Turn]]  # engine request id -> its session and turn
    _codec: CodecWorker | None
    _codec_owner: dict[int, Session]
    _finished_ids: deque[str]  # the latest responses finished (a late cancel of one is no error)
    _unstarted_ids: deque[str]  # the latest responses cancelled while they waited (a cut of one has nothing to cut)
    limits: InputLimits

    def _ramping(self) -> bool:
        """An answer still waits for its first chunk's codes. The GPU is shared by urgency: the codec's rounds are
        ~800 tiny kernels per Euler step and, run beside decode steps, each waits behind a step's kernels (a round
        takes 2-3x as long). While an answer ramps, the codec worker holds back rounds of playing answers and user
        audio is not encoded (<= ENCODE_DEFER_S); while a first-chunk round runs and none ramps, the engine skips
        its step."""
        return self.engine.num_waiting > 0 or any(
            t.response is not None and not t.response.cancelled and t.response.modality == "audio"
            and len(t.response.code_idx) < t.response.first_audio_codes for _, t in self._requests.values())

    def _on_CreateResponse(self, client: bytes, msg: m.CreateResponse) -> None:
        s = self._session(client, msg.session_id)
        try:
            self._create(s, msg)
        except Exception as e:  # noqa: BLE001 - whatever the fault, this response ends with ResponseDone
            if isinstance(e, ServiceError | EngineError):
                code = e.code
            elif isinstance(e, ValueError):  # ConfigError included: bad sampling values
                code = errors.INVALID_REQUEST
            else:
                code = errors.ENGINE_ERROR
                log.exception("CreateResponse %s failed", msg.response_id)
            self._send(client, m.Error(s.session_id, code, str(e), msg.response_id))
            self._send(client, m.ResponseDone(s.session_id, msg.response_id, "failed", reason=code))

    def _create(self, s: Session, msg: m.CreateResponse) -> None:
        self.limits.check_output(msg.sampling.max_new_tokens, msg.response_id)
        if msg.instructions is not None:
            if not msg.out_of_band:
                raise ServiceError(errors.INVALID_REQUEST, "a response's own instructions go with an out-of-band "
                                   "response only (before one in the conversation, send UpdateSession)",
                                   msg.response_id)
            self.limits.check_text("instructions", msg.instructions)
        params = sampling_params(msg.sampling)
        t = s.active
        if s.voice_waiting or s.completing is not None or (
                t is not None and (t.undo is not None or (t.response is not None and t.response.cancelled))):
            # runs when the session's voice prompt is made, the abort in flight is reported, or the last answer is done
            s.deferred.append(msg)
            return
        if t is not None and t.response is not None:
            raise ServiceError(errors.INVALID_REQUEST, f"response {t.response.response_id!r} is still in progress")
        if t is not None and t.audio_open:
            raise ServiceError(errors.INVALID_REQUEST,
                               "commit or clear the input audio buffer before creating a response")
        prefix = self.prompts.assistant_prefix_rows(msg.modality)
        if msg.instructions is not None:  # its own system turn, leaving the history with it
            prefix = self.prompts.system_rows(msg.instructions, msg.modality) + prefix
        if t is not None and s.retention is not None and s.tentative is None and self._over(
                s, t.rows_added + len(s.pending_rows) + len(prefix) + params.max_new_tokens):
            # The answer would not fit after the open user turn: that turn is undone, and prefilled again in a new
            # request once the oldest items are dropped (_submit_response).
            t.undo = "requeue"
            self.engine.abort(t.request_id)
            s.deferred.append(msg)
            return
        if t is not None and params != t.params and not self._prompt_settled(s, t, msg.modality):
            # The open request's system turn was chosen for the other modality: prefill the user turn
            # again (same rows, the system prompt for this answer) with the new settings.
            s.sampling = params
            t.undo = "requeue"
            self.engine.abort(t.request_id)
            s.deferred.append(msg)
            return
        stream = None
        if msg.modality == "audio" and self.decoder is not None:
            stream = self.decoder.open_stream(s.session_id, voice=s.voice, seed=params.seed or 0)
        try:
            t = self._submit_response(s, t, params, msg, prefix, stream)
        except BaseException:
            if stream is not None and hasattr(stream, "close"):
                stream.close()
            raise
        s.sampling = params
        before, s.answer = s.answer, None
        r = ResponseState(msg.response_id, msg.modality, time.monotonic(), prompt_rows=t.rows_added + t.rerun_rows,
                          cached_rows=t.base_rows - t.rerun_rows, prefix_last_row=prefix[-1],
                          detok=IncrementalDetokenizer(self.tokenizer), decoder_stream=stream,
                          out_of_band_prefix=len(prefix) if msg.out_of_band else None)
        if stream is not None:
            r.first_audio_codes = stream.first_audio_codes
        t.response = r
        if s.tentative is not None and s.tentative.turn is t:
            s.tentative.response_id = msg.response_id
            s.tentative.answer_item = msg.item_id or msg.response_id
            s.tentative.answer_before = before
        if s.commit_at is not None:  # where the user turn's end went before this answer (stage marks, < 0)
            r.mark("commit_in", s.commit_at)
            r.mark("commit_call", s.commit_call_at)
            r.mark("commit_encoded", s.commit_done_at)
            s.commit_at = s.commit_call_at = s.commit_done_at = None
        self._send(s.owner, m.ResponseStarted(s.session_id, msg.response_id, r.prompt_rows))

    @staticmethod
    def _prompt_settled(s: Session, t: Turn, modality: m.Modality) -> bool:
        """True when the open turn's rows fit this answer as they are: no default system prompt went in
        with it, or it was the spoken one and the answer is spoken. New sampling settings then go in with
        the closing rows (Engine.append_input(params=)) instead of a second prefill."""
        return not t.system_included or s.instructions is not None or modality == "audio"

    def _submit_response(self, s: Session, t: Turn | None, params: SamplingParams, msg: m.CreateResponse,
                         prefix: list[Row], stream: Any = None) -> Turn:
        """The response's rows into the engine: appended to the open user turn, or a new request. With its decoder
        `stream`, the engine ramps the answer (its short steps) for as many rows as its first audio waits for."""
        ramp = stream.first_audio_codes if stream is not None else None
        if t is not None:
            rows = s.pending_rows + prefix
            self.engine.append_input(t.request_id, rows, input_done=True,
                                     params=params if params != t.params else None, ramp_rows=ramp)
            if s.tentative is not None and s.tentative.turn is t:
                s.tentative.after_rows = list(s.pending_rows)
            t.params = params
            t.carried_rows = t.carried_rows + s.pending_rows
            s.pending_rows = []
            t.rows_added += len(rows)
        else:
            system = self._system_rows(s, msg.modality)
            if self._cut_to_fit(s, len(s.close_rows) + len(system) + len(s.pending_rows) + len(prefix)
                                + params.max_new_tokens):
                system = self._system_rows(s, msg.modality)
            rows = s.close_rows + system + s.pending_rows + prefix
            rid = s.new_request_id()
            base = self.engine.conversation_rows(s.conversation_id)
            rerun = self.engine.conversation_unrun_rows(s.conversation_id)
            self.engine.add_request(rid, rows, params, conversation_id=s.conversation_id, input_done=True,
                                    refill_rows=self._refill_lead(s, len(s.close_rows) + len(system)), ramp_rows=ramp)
            s.refill_rows = 0
            t = Turn(rid, base, params, close_rows=s.close_rows, carried_rows=s.pending_rows,
                     system_included=not s.system_sent, rows_added=len(rows), rerun_rows=rerun)
            s.active = t
            self._requests[rid] = (s, t)
            s.close_rows, s.pending_rows, s.system_sent = [], [], True
        if not msg.out_of_band:
            self._add_item(s, msg.item_id or msg.response_id)
        return t

    def _on_CancelResponse(self, client: bytes, msg: m.CancelResponse) -> None:
        s = self._session(client, msg.session_id)
        t = s.active
        if t is not None and t.response is not None and t.response.response_id == msg.response_id:
            if not t.response.cancelled:
                t.response.cancelled = True
                self.engine.abort(t.request_id)
            return
        if s.completing is not None and s.completing.response_id == msg.response_id:
            self._drop_last_audio(s.completing)
            return
        if any(d.response_id == msg.response_id for d in s.deferred):  # not started: it ends here
            s.deferred = [d for d in s.deferred if d.response_id != msg.response_id]
            self._unstarted_ids.append(msg.response_id)
            self._send(client, m.ResponseDone(s.session_id, msg.response_id, "cancelled", reason="client_cancelled"))
            return
        if msg.response_id in self._finished_ids:
            return  # finished already (a benign race)
        raise ServiceError(errors.INVALID_REQUEST, f"no response {msg.response_id!r} in this session", msg.response_id)

    def _on_WithdrawResponse(self, client: bytes, msg: m.WithdrawResponse) -> None:
        s = self._session(client, msg.session_id)
        w = s.tentative
        if w is None or w.response_id != msg.response_id:
            raise ServiceError(errors.INVALID_REQUEST, f"response {msg.response_id!r} does not answer a tentative "
                               "commit of this session", msg.response_id)
        t = s.active
        if t is w.turn and t.response is not None:  # still generating: stopped at the next step, then reopened
            t.response.cancelled = t.response.withdrawn = True
            t.undo = "reopen"
            self.engine.abort(t.request_id)
            return
        if s.completing is not None and s.completing.response_id == msg.response_id:
            s.completing.withdrawn = True
            self._drop_last_audio(s.completing)
        self._reopen(s)

    def _reopen(self, s: Session) -> None:
        """The tentatively committed turn is open again: the answer's rows and the turn's closing rows leave the
        conversation (their KV blocks return to the pool), the turn's audio rows stay with their KV."""
        w, s.tentative = s.tentative, None
        assert w is not None
        self.engine.truncate_conversation(s.conversation_id, w.end_row)
        if w.after_rows:  # items added while the user spoke went in with the answer: due again, after the turn
            s.pending_rows = w.after_rows + s.pending_rows
            del w.turn.carried_rows[len(w.turn.carried_rows) - len(w.after_rows):]
        # The answer before the turn is again the latest: the client may still cut it where its listener was.
        s.close_rows, s.answer = [], w.answer_before
        w.turn.committed, w.turn.audio_open, w.turn.response, w.turn.undo = False, True, None, None
        s.reopened = w.turn
        if self._speech is not None:
            self._speech.resume(s.session_id)
        s.turn_codes, s.turn_code_list = len(w.turn.codes), list(w.turn.codes)
        # The answer's item leaves with its rows; items added since (a text item, new instructions) wait in
        # pending_rows, after the turn, and stay.
        s.items = [it for it in s.items if it.item_id is None or it.item_id != w.answer_item]
        if w.item is not None and w.item in s.items:
            s.audio_item = w.item
        if w.truncate is not None:
            self._truncate(s, w.truncate)

    def _on_TruncateResponse(self, client: bytes, msg: m.TruncateResponse) -> None:
        self._truncate(self._session(client, msg.session_id), msg)

    def _truncate(self, s: Session, msg: m.TruncateResponse) -> None:
        if msg.response_id in self._unstarted_ids:
            return  # it never said anything (a listener's stop: the cancel, then the cut where it is)
        t = s.active
        if t is not None and t.response is not None and t.response.response_id == msg.response_id:
            t.response.truncate_samples = msg.audio_samples_played
            if not t.response.cancelled:
                t.response.cancelled = True
                self.engine.abort(t.request_id)
            return
        a, w = s.answer, s.tentative
        if a is None and w is not None and w.turn is t and t.undo == "reopen" and w.answer_before is not None \
                and w.answer_before.response_id == msg.response_id:
            w.truncate = msg  # the withdrawn answer stops at the next step; then the cut (_reopen)
            return
        if a is None and msg.response_id == s.moved_answer:
            return  # the cut crossed the move of its rows (the server had not heard of it): the answer stays whole
        if a is None or a.response_id != msg.response_id:
            raise ServiceError(errors.INVALID_REQUEST, f"response {msg.response_id!r} is not the latest answer of this "
                               "session (only that one can be truncated)", msg.response_id)
        if s.completing is not None and s.completing.response_id == msg.response_id:
            self._drop_last_audio(s.completing)  # the client stopped playing it
        keep = a.cut(msg.audio_samples_played)
        if keep is None:
            return
        cut_rows, last = a.gen_start + keep, a.last_row(keep)
        a.rows, a.code_idx = a.rows[:keep], [i for i in a.code_idx if i < keep]
        o = s.reopened
        if t is None and o is not None:
            # A withdrawn turn's rows follow the answer: cut there, and its codes wait to go in again after the cut.
            s.reopened = None
            o.cut_rows, o.cut_last_row, o.undo = cut_rows, last, "requeue"
            self._undo(s, o)
            return
        if t is None:
            self.engine.truncate_conversation(s.conversation_id, cut_rows)
            s.close_rows = self.prompts.assistant_close_rows(last)
            return
        # A user turn after the answer is already in the engine: undo it, cut, prefill it again.
        t.cut_rows, t.cut_last_row = cut_rows, last
        if t.undo is None:
            t.undo = "requeue"
            self.engine.abort(t.request_id)

    # ---- completion ---------------------------------------------------------------------

    def _finish(self, s: Session, t: Turn, o: StepOutput) -> None:
        self._requests.pop(t.request_id, None)
        if s.active is t:
            s.active = None
        if t.undo == "close" or self.sessions.get(s.session_id) is not s:
            if t.response is not None:
                self._end_unheard(t.response)
            self._release(s)
            return
        if o.finish_reason == "no_kv":
            self._refused(s, t)
            return
        if t.undo is not None and t.response is None:
            self._undo(s, t)
        elif t.response is not None:
            self._finish_response(s, t, t.response, o)
            if t.undo == "reopen":
                self._reopen(s)
        self._pump(s)
        deferred, s.deferred = s.deferred, []
        for d in deferred:
            self._on_CreateResponse(s.owner, d)

    def _refused(self, s: Session, t: Turn) -> None:
        """A request the scheduler refused while it waited ("no_kv": other conversations' histories hold the KV
        pool): its rows are put back as pending, as if it had never been sent (the next answer tries them again, and
        is refused at once while there is still no room); its answer, if any, fails with server_busy."""
        r = t.response
        self._send(s.owner, m.Error(s.session_id, errors.SERVER_BUSY, "the engine's KV pool has no room for this turn "
                                    "now: other conversations' histories hold it", r.response_id if r else None))
        if t.undo is None:  # (an undo asked for meanwhile keeps its own kind: cleared audio stays cleared)
            t.undo = "requeue"
        self._undo(s, t)
        if r is not None:
            _close_decoder_stream(r)
            r.done = ("failed", errors.SERVER_BUSY)
            self._finished_ids.append(r.response_id)
            self._complete(s, r)
        deferred, s.deferred = s.deferred, []
        for d in deferred:
            self._on_CreateResponse(s.owner, d)

    def _undo(self, s: Session, t: Turn) -> None:
        if t.cut_rows is not None:
            self.engine.truncate_conversation(s.conversation_id, t.cut_rows)
            s.close_rows = self.prompts.assistant_close_rows(t.cut_last_row)
        else:
            self.engine.truncate_conversation(s.conversation_id, t.base_rows)
            s.close_rows = t.close_rows
            if t.system_included:
                s.system_sent = False
        restored = list(t.carried_rows)
        if t.undo == "requeue":
            if t.committed:
                restored += self.prompts.user_audio_turn_rows(t.codes)
            else:
                s.pending_codes = t.codes + s.pending_codes
        s.pending_rows = restored + s.pending_rows

    def _finish_response(self, s: Session, t: Turn, r: ResponseState, o: StepOutput) -> None:
        stream, r.decoder_stream = r.decoder_stream, None
        last_codes: list[int] = []
        if stream is not None:
            # The answer's last codes, its final partial chunk and the vocoder tail: on the codec worker this
            # queues behind the stream's earlier chunks, and the engine keeps stepping meanwhile (a long answer's
            # undecoded codes are seconds of codec work); ResponseDone follows the audio.
            last_codes = [] if r.cancelled else r.new_codes
            r.new_codes = []
        self._text(s, r, r.detok.flush())
        gen_start = self.engine.conversation_rows(s.conversation_id) - len(r.rows)
        if r.out_of_band_prefix is not None:  # its prompt's own rows and its answer leave; what came before stays
            self.engine.truncate_conversation(s.conversation_id, gen_start - r.out_of_band_prefix)
            s.close_rows = []
        else:
            a = Answer(r.response_id, gen_start, r.rows, r.code_idx, r.prefix_last_row)
            keep = a.cut(r.truncate_samples) if r.truncate_samples is not None else None
            if keep is not None:
                self.engine.truncate_conversation(s.conversation_id, gen_start + keep)
                a.rows, a.code_idx = a.rows[:keep], [i for i in a.code_idx if i < keep]
            s.close_rows = self.prompts.assistant_close_rows(a.last_row(len(a.rows)))
            s.answer = a
        self._finished_ids.append(r.response_id)
        reason = o.finish_reason
        status, why = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens"),
                       "abort": ("cancelled", "client_cancelled")}.get(reason, ("failed", reason))
        r.done = (status, why)
        if stream is None:
            self._complete(s, r)
        else:
            s.completing = r
            self._codec_owner[id(r)] = s
            self._codec.push(r, stream, last_codes, final=True)
            if r.cancelled:
                self._codec.cancel(r)

    def _fail(self, s: Session, r: ResponseState, why: str, code: str = errors.ENGINE_ERROR) -> None:
        """Stop a response for a server-side fault: abort it; its ResponseDone says failed."""
        self._send(s.owner, m.Error(s.session_id, code, why, r.response_id))
        r.failed, r.cancelled, r.decoder_stream, r.new_codes = why, True, None, []
        t = s.active
        if t is not None and t.response is r:
            self.engine.abort(t.request_id)

    def _end_unheard(self, r: ResponseState) -> None:
        """A closed session's answer: its decoder stream is closed, by the codec worker when the worker has its audio
        (an empty final result then ends the worker's part), or here."""
        r.done = ("cancelled", "client_cancelled")
        self._drop_last_audio(r)
        if self._codec is not None and id(r) in self._codec_owner:
            stream, r.decoder_stream = r.decoder_stream, None
            self._codec.push(r, stream, [], final=True)
        else:
            _close_decoder_stream(r)

    def _drop_last_audio(self, r: ResponseState) -> None:
        """A finished answer whose last audio is still decoding will not be heard: send none, decode no more."""
        r.cancelled = True
        if self._codec is not None:
            self._codec.cancel(r)

    def _complete(self, s: Session, r: ResponseState) -> None:
        """ResponseDone once the answer's last audio is out; then any response asked for meanwhile."""
        status, why = r.done
        if r.cancelled:
            status, why = ("failed", errors.ENGINE_ERROR) if r.failed else (
                "cancelled", "withdrawn" if r.withdrawn else "client_cancelled")
        if r.ttfa_ms is not None:
            log.info("response %s: first audio at %.1f ms; stages %s", r.response_id, r.ttfa_ms, r.marks)
        if self.sessions.get(s.session_id) is not s:  # closed meanwhile: nobody to tell
            return
        self._send(s.owner, m.ResponseDone(
            s.session_id, r.response_id, status, reason=why, output_rows=len(r.rows), prompt_rows=r.prompt_rows,
            cached_rows=r.cached_rows, audio_samples=r.audio_samples, text="".join(r.text),
            engine_ttfa_ms=r.ttfa_ms))
        if s.completing is r:
            s.completing = None
            if s.active is None and self.sessions.get(s.session_id) is s:
                deferred, s.deferred = s.deferred, []
                for d in deferred:
                    self._on_CreateResponse(s.owner, d)


def _close_decoder_stream(r: ResponseState) -> None:
    """The answer's decoder state is freed now (no codec worker has it)."""
    stream, r.decoder_stream = r.decoder_stream, None
    if stream is not None and hasattr(stream, "close"):
        stream.close()
