"""Input transcription by the model itself: a committed user audio turn (CommitUserAudio with `transcribe`) is
written down by MOSS-Speech in text mode, as a background request of its own (Scheduler: it runs only on what
answers leave, never beside an answer's first rows, in no conversation, its KV blocks back at its end) over a
transcription instruction and the turn's speech codes, those the encoder already made for the turn's prefill.
Its text streams as TranscriptionDelta and ends in one TranscriptionDone (failed, with the reason, when the engine
refuses or drops it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engines.api import EngineError, SamplingParams, StepOutput
from engines.process.prompt import PromptBuilder
from engines.process.sessions import Session
from engines.process.tokenizer import IncrementalDetokenizer, TextTokenizer
from engines.protocol import errors
from engines.protocol import messages as m
from engines.tokens import TEXT_STOP_TOKENS, Row

log = logging.getLogger("engines.process")

TRANSCRIBE_INSTRUCTION = ("Write down exactly what the speaker says, word for word, in the language spoken. "
                          "Reply with the words only.")
# Text rows a transcription may take: a few, and one per speech code (80 ms), more than any speech needs.
TRANSCRIPT_BASE_ROWS = 16
TRANSCRIPT_MAX_ROWS = 1024


@dataclass
class Transcript:
    session: Session
    item_id: str
    detok: IncrementalDetokenizer
    prompt_rows: int
    text: list[str] = field(default_factory=list)
    output_rows: int = 0


def transcription_rows(prompts: PromptBuilder, codes: list[int]) -> list[Row]:
    """The instruction as the system turn, the user's speech, and a text answer's prefix."""
    return (prompts.text_turn_rows("system", TRANSCRIBE_INSTRUCTION) + prompts.user_audio_turn_rows(codes)
            + prompts.assistant_prefix_rows("text"))


class Transcripts:
    """Part of Service (service.py): the transcriptions of committed turns. Calls Outputs' _send (outputs.py)."""

    engine: Any
    tokenizer: TextTokenizer
    prompts: PromptBuilder
    sessions: dict[str, Session]
    _transcripts: dict[str, Transcript]  # engine request id -> its transcription

    def _transcribe(self, s: Session, item_id: str, codes: list[int]) -> None:
        if not codes:
            self._send(s.owner, m.TranscriptionDone(s.session_id, item_id, "failed", code=errors.INVALID_REQUEST,
                                                    reason="the turn holds no speech"))
            return
        rows = transcription_rows(self.prompts, codes)
        rid = f"{s.new_request_id()}:transcript"
        params = SamplingParams.greedy_params(max_new_tokens=min(TRANSCRIPT_BASE_ROWS + len(codes),
                                                                 TRANSCRIPT_MAX_ROWS))
        try:
            self.engine.add_request(rid, rows, params, background=True)
        except EngineError as e:
            self._send(s.owner, m.TranscriptionDone(s.session_id, item_id, "failed", code=e.code, reason=str(e)))
            return
        self._transcripts[rid] = Transcript(s, item_id, IncrementalDetokenizer(self.tokenizer), len(rows))

    def _transcript_row(self, o: StepOutput) -> bool:
        """A row of a transcription (False: the output is not one's)."""
        tr = self._transcripts.get(o.request_id)
        if tr is None:
            return False
        s = tr.session
        if o.finish_reason not in ("abort", "no_kv"):  # those outputs carry no row
            tr.output_rows += 1
            if o.text_token not in TEXT_STOP_TOKENS:
                self._transcript_text(tr, tr.detok.push(o.text_token))
        if not o.finished:
            return True
        del self._transcripts[o.request_id]
        if self.sessions.get(s.session_id) is not s:  # closed meanwhile
            return True
        self._transcript_text(tr, tr.detok.flush())
        if o.finish_reason == "abort":
            self._send(s.owner, m.TranscriptionDone(s.session_id, tr.item_id, "failed", "".join(tr.text),
                                                    code=errors.ENGINE_ERROR, reason="the transcription was stopped",
                                                    prompt_rows=tr.prompt_rows, output_rows=tr.output_rows))
        elif o.finish_reason == "no_kv":  # refused while it waited: only the transcription fails, no answer
            self._send(s.owner, m.TranscriptionDone(s.session_id, tr.item_id, "failed", code=errors.SERVER_BUSY,
                                                    reason="the engine's KV pool has no room for the transcription "
                                                    "now: conversations' histories hold it",
                                                    prompt_rows=tr.prompt_rows))
        else:
            self._send(s.owner, m.TranscriptionDone(s.session_id, tr.item_id, "completed", "".join(tr.text).strip(),
                                                    prompt_rows=tr.prompt_rows, output_rows=tr.output_rows))
        return True

    def _transcript_text(self, tr: Transcript, delta: str) -> None:
        if delta:
            tr.text.append(delta)
            s = tr.session
            self._send(s.owner, m.TranscriptionDelta(s.session_id, tr.item_id, delta))

    def _drop_transcripts(self, s: Session) -> None:
        """The session closed: its transcriptions stop (their blocks go back when the engine reports the abort)."""
        for rid, tr in self._transcripts.items():
            if tr.session is s:
                self.engine.abort(rid)
