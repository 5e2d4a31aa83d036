"""The user's side of a turn in the engine service: audio to the speech encoder, its codes into the engine as rows
while the user talks, the commit that closes the turn, cleared audio, and text items.

User audio goes to the encoder worker (encoder_worker.py), which encodes every session's together. A session's codes
open an engine request at the first one (the user turn, `input_done=False`) and grow it by a row a code; while a
response or an undo is in flight they wait in the session (sessions.py). A session's messages after a commit wait
until the encoder has finalized the turn. The commit's result also carries the turn's codes as the whole-segment
log-mel floor makes them (encoder_worker.py): those that change are rewritten where they are, in the engine's rows
(their KV computed again) or still waiting in the session, before the turn is closed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from engines.api import SamplingParams
from engines.audio.wav import pcm16_to_float32
from engines.process.encoder_worker import EncoderWorker
from engines.process.errors import ServiceError, speech_error
from engines.process.history import AUDIO_TURN_RESERVE
from engines.process.limits import InputLimits
from engines.process.prompt import PromptBuilder
from engines.process.sessions import Session, Tentative, Turn
from engines.protocol import errors
from engines.protocol import messages as m
from engines.tokens import Row

if TYPE_CHECKING:
    from engines.speech_in.segment_floor import Refloor

log = logging.getLogger("engines.process")


class UserInput:
    """Part of Service (service.py): the user's messages of a turn. Calls Service's _session, and its _dispatch,
    _guard and _report for the messages that waited for a commit; Outputs' _send (outputs.py)."""

    engine: Any
    prompts: PromptBuilder
    sessions: dict[str, Session]
    _speech: EncoderWorker | None
    _requests: dict[str, tuple[Session, Turn]]  # engine request id -> its session and turn
    limits: InputLimits
    max_waiting_rows: int | None  # rows a session's items may hold before an answer sends them (None: no bound)

    def handle_early(self, items: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
        """Messages that arrived while the engine waits for a step's tokens (from inside Engine.step's `on_wait`):
        user audio and commits go to the encoder's thread now (a commit waited half a step on average for the loop);
        everything else, and every later message of the same session, is returned in order, to be handled after the
        step. Nothing here touches the engine's requests."""
        later: list[tuple[bytes, Any]] = []
        blocked: set[Any] = set()  # sessions with a message put off: their next ones must follow it
        for client, msg in items:
            sid = getattr(msg, "session_id", None)
            s = self.sessions.get(sid)
            if (self._speech is None or not self._speech.threaded or sid in blocked or s is None or s.owner != client
                    or not self._early(client, msg, s)):
                later.append((client, msg))
                blocked.add(sid)
        return later

    def _early(self, client: bytes, msg: Any, s: Session) -> bool:
        """Handle user audio or a commit now if that needs only the encoder's worker; False: it must wait."""
        if s.commit_pending is not None:  # waits for the commit in flight, as in handle_many
            if isinstance(msg, m.AppendUserAudio | m.CommitUserAudio):
                s.after_commit.append((client, msg))
                return True
            return False
        if isinstance(msg, m.AppendUserAudio):
            self._dispatch(client, msg)
            return True
        # (A commit with no audio left to finalize ends the turn in the engine: after the step.)
        return isinstance(msg, m.CommitUserAudio) and self._start_commit(client, msg, s)

    def _on_AppendUserAudio(self, client: bytes, msg: m.AppendUserAudio) -> None:
        s = self._session(client, msg.session_id)
        if self._speech is None:
            raise ServiceError(errors.INVALID_REQUEST, "this engine has no speech encoder loaded")
        pcm = pcm16_to_float32(msg.pcm16k)  # odd length: ValueError
        self._speech.append(s.session_id, pcm)

    def _run_encoder(self, flush: bool) -> None:
        """Codes the encoder worker has produced go to their sessions; without its thread, the calls that are due
        run here first (`flush`: held audio too, whatever the interval), until none is (a commit's delivery may
        hand over the messages that waited for it, and with them more audio or another commit)."""
        if self._speech is None:
            return
        while True:
            ran = not self._speech.threaded and self._speech.run_due(flush)
            results = self._speech.take_results()
            for e in results:
                s = self.sessions.get(e.key)
                if s is None:
                    continue
                if e.commit:
                    self._commit_done(s, e.codes, e.at, e.started, e.refloor)
                elif isinstance(e.codes, Exception):
                    self._speech_failed(s, e.codes)
                else:
                    self._guard(s.owner, m.AppendUserAudio(s.session_id, b""), self._encoded, s, e.codes, e.refloor)
            if not ran and not results:
                return

    def _on_CommitUserAudio(self, client: bytes, msg: m.CommitUserAudio) -> None:
        s = self._session(client, msg.session_id)
        if not self._start_commit(client, msg, s):  # no audio is left to finalize
            self._committed(s, [], msg)

    def _start_commit(self, client: bytes, msg: m.CommitUserAudio, s: Session) -> bool:
        """The encoder finalizes the turn (False: it holds none of it); the session's next messages wait for that."""
        if self._speech is None or not self._speech.commit(s.session_id, final=not msg.tentative):
            return False
        s.commit_pending, s.commit_at = (client, msg), time.monotonic()
        return True

    def _commit_done(self, s: Session, codes: list[int] | Exception, at: float, started: float,
                     refloor: Refloor | None = None) -> None:
        """The committed turn's last codes (or the encoder's failure), produced `at` by a call that began `started`,
        and its codes that the whole-segment floor changes; then the messages that waited for them."""
        (client, msg), waiting = s.commit_pending, s.after_commit
        s.commit_pending, s.after_commit = None, []
        s.commit_call_at, s.commit_done_at = started, at
        if isinstance(codes, Exception):  # the turn so far is dropped, as when a call of held audio fails
            log.error("speech encoder failed for session %s's commit: %r", s.session_id, codes)
            self._report(client, msg, codes if isinstance(codes, ValueError) else speech_error(codes))
            self._clear_speech(s)
        else:
            self._guard(client, msg, self._committed, s, codes, msg, refloor)
        for i, (c, queued) in enumerate(waiting):
            if s.commit_pending is not None:  # committed again: the rest waits for that one
                s.after_commit += waiting[i:]
                return
            self._dispatch(c, queued)

    def _committed(self, s: Session, codes: list[int], msg: m.CommitUserAudio, refloor: Refloor | None = None
                   ) -> None:
        """The user's turn (the commit's item) ends with these last codes (its encoder stream is finalized, or kept
        if `tentative`), its codes first made those of the whole-segment floor (`refloor`). A tentative turn is
        transcribed once it stands (confirmed, or another turn begun), never if withdrawn: the turn then goes on,
        and its final commit transcribes all of it."""
        if s.turn_codes + len(codes) == 0:
            raise ServiceError(errors.INVALID_REQUEST, "the input audio buffer holds no speech to commit")
        if refloor is not None:
            codes = self._refloor(s, codes, refloor)
        self._settle_tentative(s)
        s.commit_item = msg.item_id
        self._user_codes(s, codes, commit=True)
        turn = s.turn_code_list
        s.turn_codes, s.turn_code_list = 0, []
        t = s.active
        transcript = (msg.item_id, turn) if msg.transcribe else None
        if msg.tentative and t is not None and t.committed and t.response is None and t.undo is None:
            # The turn's item (named by the commit just now); items added while the user spoke (new instructions)
            # follow it.
            item = next(it for it in reversed(s.items) if it.item_id == msg.item_id)
            s.tentative = Tentative(t, t.base_rows + t.user_end, item=item, transcript=transcript)
            return
        if msg.tentative and self._speech is not None:  # it could not be taken back: it stands
            self._speech.drop(s.session_id)
        if transcript is not None:
            self._transcribe(s, *transcript)

    def _encoded(self, s: Session, codes: list[int], refloor: Refloor | None) -> None:
        """More codes of the user's turn (and, past a 30 s segment's end, its codes there with that segment's floor)."""
        self._user_codes(s, codes if refloor is None else self._refloor(s, codes, refloor), False)

    def _refloor(self, s: Session, codes: list[int], r: Refloor) -> list[int]:
        """The turn's codes r.first.. made r.codes (with `codes`, the encoder's latest, its codes so far): those the
        engine holds are rewritten there from the first that changes (their KV computed again before the answer's
        first row), those still waiting are replaced. Returns `codes` as they now are."""
        t, o = s.active, s.reopened if s.active is None else None
        live = t is not None and t.audio_open and t.undo is None and t.response is None
        # An open turn being undone to be prefilled again (a truncation behind it) puts its codes back as pending.
        requeued = t is not None and t.audio_open and t.undo == "requeue" and not t.committed
        sent = o.codes if o is not None else t.codes if live or requeued else []
        held = sent + s.pending_codes + codes
        end = r.first + len(r.codes)
        if r.total != len(held) or end > len(held):  # (the turn's codes went elsewhere)
            log.warning("session %s: the turn re-encoded has %d codes, %d are held; they stand", s.session_id,
                        r.total, len(held))
            return codes
        new = held[: r.first] + r.codes + held[end:]
        n = len(sent)
        d = next((i for i in range(r.first, min(n, end)) if new[i] != sent[i]), n)
        owner = o if o is not None else t
        if d < n and owner is not None:
            at = owner.base_rows + owner.user_rows_start + len(self.prompts.audio_turn_open_rows()) + d
            if o is not None:  # a withdrawn turn's rows end the conversation: its next request carries them again
                self.engine.truncate_conversation(s.conversation_id, at)
                o.codes, o.user_end, n = new[:d], o.user_end - (n - d), d
            elif requeued:  # (its request is being aborted: the codes go back as they are now)
                owner.codes[d:min(n, end)] = new[d:min(n, end)]
            else:
                upto = min(n, end)
                self.engine.rewrite_input(owner.request_id, at, self.prompts.audio_code_rows(new[d:upto]))
                owner.codes[d:upto] = new[d:upto]
        last = len(held) - len(codes)
        s.pending_codes = new[n:last]
        s.turn_code_list = new[last - len(s.turn_code_list):last]
        return new[last:]

    def _settle_tentative(self, s: Session) -> None:
        """The tentative commit stands: its turn is transcribed if asked."""
        w, s.tentative = s.tentative, None
        if w is not None and w.transcript is not None:
            self._transcribe(s, *w.transcript)

    def _on_ConfirmUserAudio(self, client: bytes, msg: m.ConfirmUserAudio) -> None:
        s = self._session(client, msg.session_id)
        self._settle_tentative(s)
        if self._speech is not None:
            self._speech.drop(s.session_id)

    def _speech_failed(self, s: Session, e: Exception) -> None:
        """The encoder failed on this session's audio: the turn so far is dropped, as if the client cleared it."""
        log.error("speech encoder failed for session %s: %r", s.session_id, e)
        err = speech_error(e)
        self._send(s.owner, m.Error(s.session_id, err.code, str(err)))
        self._clear_speech(s)

    def _on_ClearUserAudio(self, client: bytes, msg: m.ClearUserAudio) -> None:
        self._clear_speech(self._session(client, msg.session_id))

    def _clear_speech(self, s: Session) -> None:
        if self._speech is not None:
            self._speech.drop(s.session_id)
        s.pending_codes = []
        s.turn_codes, s.turn_code_list = 0, []
        self._settle_tentative(s)
        if s.reopened is not None:  # a withdrawn turn's rows end the conversation: they go, as its undo would
            o, s.reopened = s.reopened, None
            self.engine.truncate_conversation(s.conversation_id, o.base_rows)
            s.close_rows, s.pending_rows = o.close_rows, list(o.carried_rows) + s.pending_rows
            s.system_sent = s.system_sent and not o.system_included
        self._audio_turn_out(s)
        t = s.active
        if t is not None and t.audio_open and t.undo in (None, "requeue"):
            t.undo = "clear"
            self.engine.abort(t.request_id)

    def _on_AddUserText(self, client: bytes, msg: m.AddUserText) -> None:
        s = self._session(client, msg.session_id)
        self.limits.check_text("text", msg.text)
        if msg.role == "system" and not s.system_sent and s.instructions is None:
            s.instructions = msg.text  # the first system item is the system prompt
            return
        rows = self.prompts.text_turn_rows(msg.role, msg.text)
        if self.max_waiting_rows is not None:
            self.limits.check_waiting_rows(len(s.close_rows) + len(s.pending_rows) + len(rows), self.max_waiting_rows)
        s.pending_rows += rows
        self._add_item(s, msg.item_id, pinned=msg.role == "system")

    def _user_codes(self, s: Session, codes: list[int], commit: bool) -> None:
        s.pending_codes += codes
        s.pending_commit = s.pending_commit or commit
        s.turn_codes += len(codes)
        s.turn_code_list += codes
        sent = self._pump(s)
        self._send(s.owner, m.UserAudioProgress(s.session_id, s.turn_codes, sent))

    def _pump(self, s: Session) -> int:
        """Move pending speech codes into the engine; returns the rows of the user turn sent so far."""
        t = s.active
        if t is None and s.reopened is not None and (s.pending_codes or s.pending_commit):
            t = self._continue_turn(s)
        elif t is None and s.pending_codes:
            params = s.sampling or SamplingParams()
            turn = self.prompts.audio_turn_open_rows() + self.prompts.audio_code_rows(s.pending_codes)
            user_turn_end = len(turn)
            if s.pending_commit:
                turn += self.prompts.audio_turn_close_rows()
            system = self._system_rows(s, "audio")
            if self._cut_to_fit(s, len(s.close_rows) + len(system) + len(s.pending_rows) + len(turn)
                                + params.max_new_tokens + AUDIO_TURN_RESERVE):
                system = self._system_rows(s, "audio")
            lead = s.close_rows + system + s.pending_rows
            rows = lead + turn
            user_end = len(lead) + user_turn_end
            rid = s.new_request_id()
            base = self.engine.conversation_rows(s.conversation_id)
            rerun = self.engine.conversation_unrun_rows(s.conversation_id)
            self.engine.add_request(rid, rows, params, conversation_id=s.conversation_id, input_done=False,
                                    refill_rows=self._refill_lead(s, len(s.close_rows) + len(system)))
            s.refill_rows = 0
            self._audio_turn_in(s)
            if s.pending_commit:
                self._audio_turn_named(s)
            t = Turn(rid, base, params, close_rows=s.close_rows, carried_rows=s.pending_rows,
                     system_included=not s.system_sent, codes=list(s.pending_codes),
                     audio_open=not s.pending_commit, committed=s.pending_commit, rows_added=len(rows),
                     rerun_rows=rerun, user_rows_start=len(lead), user_end=user_end)
            s.active = t
            self._requests[rid] = (s, t)
            s.close_rows, s.pending_rows, s.system_sent = [], [], True
            s.pending_codes, s.pending_commit = [], False
        elif t is not None and t.audio_open and t.undo is None:
            rows = self.prompts.audio_code_rows(s.pending_codes)
            t.user_end = t.rows_added + len(rows)
            if s.pending_commit:
                rows += self.prompts.audio_turn_close_rows()
            if rows:
                self.engine.append_input(t.request_id, rows, input_done=False)
                t.rows_added += len(rows)
                t.codes += s.pending_codes
            if s.pending_commit:
                t.audio_open, t.committed = False, True
                self._audio_turn_named(s)
            s.pending_codes, s.pending_commit = [], False
        elif s.pending_commit:
            # A response or an undo is in flight: the committed turn waits whole.
            s.pending_rows += self.prompts.user_audio_turn_rows(s.pending_codes)
            self._audio_turn_in(s)
            self._audio_turn_named(s)
            s.pending_codes, s.pending_commit = [], False
        t = s.active
        if t is None or t.response is not None or not t.codes:
            return 0
        return t.rows_added - t.user_rows_start

    def _continue_turn(self, s: Session) -> Turn:
        """A withdrawn turn's next codes (and its commit): a request that extends the conversation, whose last rows
        are that turn's audio with its KV, and carries on the turn's bookkeeping (an undo takes the whole turn)."""
        o, s.reopened = s.reopened, None
        rows = self.prompts.audio_code_rows(s.pending_codes)
        user_end = o.user_end + len(rows)
        if s.pending_commit:
            rows += self.prompts.audio_turn_close_rows()
        rid = s.new_request_id()
        self.engine.add_request(rid, rows, o.params, conversation_id=s.conversation_id, input_done=False)
        if s.pending_commit:
            self._audio_turn_named(s)
        t = Turn(rid, o.base_rows, o.params, close_rows=o.close_rows, carried_rows=o.carried_rows,
                 system_included=o.system_included, codes=o.codes + s.pending_codes, audio_open=not s.pending_commit,
                 committed=s.pending_commit, rows_added=o.user_end + len(rows), rerun_rows=o.rerun_rows,
                 user_rows_start=o.user_rows_start, user_end=user_end)
        s.active = t
        self._requests[rid] = (s, t)
        s.pending_codes, s.pending_commit = [], False
        return t

    def _system_rows(self, s: Session, modality: m.Modality) -> list[Row]:
        if s.system_sent:
            return []
        return self.prompts.system_rows(s.instructions, modality)
