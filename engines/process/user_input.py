"""The user's side of a turn in the engine service: audio to the speech encoder, its codes into the engine as rows
while the user talks, the commit that closes the turn, cleared audio, and text items.

User audio goes to the encoder worker (encoder_worker.py), which encodes every session's together. A session's codes
open an engine request at the first one (the user turn, `input_done=False`) and grow it by a row a code; while a
response or an undo is in flight they wait in the session (sessions.py). A session's messages after a commit wait
until the encoder has finalized the turn.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engines.api import SamplingParams
from engines.audio.wav import pcm16_to_float32
from engines.process.encoder_worker import EncoderWorker
from engines.process.errors import ServiceError, speech_error
from engines.process.history import AUDIO_TURN_RESERVE
from engines.process.prompt import PromptBuilder
from engines.process.sessions import Session, Turn
from engines.protocol import errors
from engines.protocol import messages as m
from engines.tokens import Row

log = logging.getLogger("engines.process")


class UserInput:
    """Part of Service (service.py): the user's messages of a turn. Calls Service's _session, and its _dispatch,
    _guard and _report for the messages that waited for a commit; Outputs' _send (outputs.py)."""

    engine: Any
    prompts: PromptBuilder
    sessions: dict[str, Session]
    _speech: EncoderWorker | None
    _requests: dict[str, tuple[Session, Turn]]  # engine request id -> its session and turn

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
                    self._commit_done(s, e.codes, e.at, e.started)
                elif isinstance(e.codes, Exception):
                    self._speech_failed(s, e.codes)
                else:
                    self._guard(s.owner, m.AppendUserAudio(s.session_id, b""), self._user_codes, s, e.codes, False)
            if not ran and not results:
                return

    def _on_CommitUserAudio(self, client: bytes, msg: m.CommitUserAudio) -> None:
        s = self._session(client, msg.session_id)
        if not self._start_commit(client, msg, s):  # no audio is left to finalize
            self._committed(s, [], msg)

    def _start_commit(self, client: bytes, msg: m.CommitUserAudio, s: Session) -> bool:
        """The encoder finalizes the turn (False: it holds none of it); the session's next messages wait for that."""
        if self._speech is None or not self._speech.commit(s.session_id):
            return False
        s.commit_pending, s.commit_at = (client, msg), time.monotonic()
        return True

    def _commit_done(self, s: Session, codes: list[int] | Exception, at: float, started: float) -> None:
        """The committed turn's last codes (or the encoder's failure), produced `at` by a call that began `started`;
        then the messages that waited for them."""
        (client, msg), waiting = s.commit_pending, s.after_commit
        s.commit_pending, s.after_commit = None, []
        s.commit_call_at, s.commit_done_at = started, at
        if isinstance(codes, Exception):  # the turn so far is dropped, as when a call of held audio fails
            log.error("speech encoder failed for session %s's commit: %r", s.session_id, codes)
            self._report(client, msg, codes if isinstance(codes, ValueError) else speech_error(codes))
            self._clear_speech(s)
        else:
            self._guard(client, msg, self._committed, s, codes, msg)
        for i, (c, queued) in enumerate(waiting):
            if s.commit_pending is not None:  # committed again: the rest waits for that one
                s.after_commit += waiting[i:]
                return
            self._dispatch(c, queued)

    def _committed(self, s: Session, codes: list[int], msg: m.CommitUserAudio) -> None:
        """The user's turn (the commit's item) ends with these last codes (its encoder stream is finalized)."""
        if s.turn_codes + len(codes) == 0:
            raise ServiceError(errors.INVALID_REQUEST, "the input audio buffer holds no speech to commit")
        s.commit_item = msg.item_id
        self._user_codes(s, codes, commit=True)
        turn = s.turn_code_list
        s.turn_codes, s.turn_code_list = 0, []
        if msg.transcribe:
            self._transcribe(s, msg.item_id, turn)

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
        self._audio_turn_out(s)
        t = s.active
        if t is not None and t.audio_open and t.undo in (None, "requeue"):
            t.undo = "clear"
            self.engine.abort(t.request_id)

    def _on_AddUserText(self, client: bytes, msg: m.AddUserText) -> None:
        s = self._session(client, msg.session_id)
        if msg.role == "system" and not s.system_sent and s.instructions is None:
            s.instructions = msg.text  # the first system item is the system prompt
            return
        s.pending_rows += self.prompts.text_turn_rows(msg.role, msg.text)
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
        if t is None and s.pending_codes:
            params = s.sampling or SamplingParams()
            turn = self.prompts.audio_turn_open_rows() + self.prompts.audio_code_rows(s.pending_codes)
            if s.pending_commit:
                turn += self.prompts.audio_turn_close_rows()
            system = self._system_rows(s, "audio")
            if self._cut_to_fit(s, len(s.close_rows) + len(system) + len(s.pending_rows) + len(turn)
                                + params.max_new_tokens + AUDIO_TURN_RESERVE):
                system = self._system_rows(s, "audio")
            lead = s.close_rows + system + s.pending_rows
            rows = lead + turn
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
                     rerun_rows=rerun, user_rows_start=len(lead))
            s.active = t
            self._requests[rid] = (s, t)
            s.close_rows, s.pending_rows, s.system_sent = [], [], True
            s.pending_codes, s.pending_commit = [], False
        elif t is not None and t.audio_open and t.undo is None:
            rows = self.prompts.audio_code_rows(s.pending_codes)
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

    def _system_rows(self, s: Session, modality: m.Modality) -> list[Row]:
        if s.system_sent:
            return []
        return self.prompts.system_rows(s.instructions, modality)
