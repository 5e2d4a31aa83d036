"""Per-session state of the engine service: what has been sent to the engine and what is still due.

A session is one conversation in the engine (conversation id = session id). At most one engine
request per session is live at a time; it is a `Turn`:

- A user audio turn opens a request with `input_done=False` at the first speech code
  (`<|im_start|>user\\n` + sosp + codes), grows by one row per code while the user talks, gets its
  closing rows (eosp, `<|im_end|>\\n`) at commit, and becomes the response's request when the
  assistant prefix is appended with `input_done=True` (incremental prefill).
- Otherwise a response opens a request with all its new rows at once.

Rows that cannot go to the engine yet wait in the session: `close_rows` (what makes the previous
answer's turn well-formed, see PromptBuilder.assistant_close_rows), `pending_rows` (queued text
turns and committed audio turns) and `pending_codes` (speech codes while a response runs).

A turn can be undone (input audio cleared; truncation of the answer before it; new sampling
settings that the open request cannot take): its request is aborted, and when the engine reports
the abort the conversation is truncated back and the turn's rows are put back as pending.

A tentative commit (the server's end-of-turn guess) closes the turn and an answer may start on it; if the user goes
on speaking the answer is withdrawn: aborted, the conversation truncated to the turn's last code (`Tentative`), and
the turn open again (`Session.reopened`) with its KV kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.api import SamplingParams
from engines.process.tokenizer import IncrementalDetokenizer
from engines.protocol.messages import AUTO_RETENTION, CreateResponse, Modality, TruncateResponse
from engines.tokens import NUM_AUDIO_CODES, Row

SAMPLES_PER_CODE = 1920  # 24 kHz output / 12.5 codes per second


@dataclass
class ResponseState:
    response_id: str
    modality: Modality
    t0: float  # time.monotonic() when CreateResponse arrived
    prompt_rows: int  # rows of this request (user audio already prefilled included)
    cached_rows: int  # history reused from the KV cache
    prefix_last_row: Row  # last prompt row (the history's last row if nothing is generated)
    detok: IncrementalDetokenizer
    decoder_stream: Any = None  # codec decoder stream (audio modality)
    # Codes its first audio waits for: its decoder stream's `first_audio_codes` (8, a 5-code chunk and its 3
    # lookahead codes, without a stream). Until then it ramps (Service._ramping).
    first_audio_codes: int = 8
    rows: list[Row] = field(default_factory=list)  # generated rows
    code_idx: list[int] = field(default_factory=list)  # index in `rows` of each audio code
    new_codes: list[int] = field(default_factory=list)  # codes not yet given to the decoder
    text: list[str] = field(default_factory=list)
    chunks: int = 0
    audio_samples: int = 0
    ttfa_ms: float | None = None
    cancelled: bool = False
    withdrawn: bool = False  # WithdrawResponse: its ResponseDone says so
    failed: str | None = None  # a server-side fault stopped it (ResponseDone status "failed")
    truncate_samples: int | None = None  # TruncateResponse received while still running
    # Out of band: the rows of its own prompt (its instructions, the assistant's header) before its answer; they leave
    # the history with it
    out_of_band_prefix: int | None = None
    done: Any = None  # ResponseDone, built once its last audio is out (Service._complete)
    marks: dict[str, float] = field(default_factory=dict)  # ms since t0 when each stage first happened

    def mark(self, stage: str, at: float | None = None) -> None:
        """Time to this stage (first time only; `at`: when it happened, time.monotonic(), default now): where a
        slow time to first audio went."""
        self.marks.setdefault(stage, round(self.elapsed_ms() if at is None else (at - self.t0) * 1000.0, 1))

    def add_row(self, text: int, audio: int, mode: str) -> None:
        if mode == "audio" and 0 <= audio < NUM_AUDIO_CODES:
            self.code_idx.append(len(self.rows))
            self.new_codes.append(audio)
        self.rows.append((text, audio))

    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.t0) * 1000.0


@dataclass
class Answer:
    """A finished response, kept so that it can be truncated to what the user heard."""

    response_id: str
    gen_start: int  # conversation row of its first generated row
    rows: list[Row]
    code_idx: list[int]
    prefix_last_row: Row

    def cut(self, samples_played: int) -> int | None:
        """Generated rows to keep so the history holds only the codes heard; None = keep all.

        Codes heard = samples // 1920 (only whole codes). Rows are kept up to and including the
        row of the last heard code; with no code heard, up to the row before the first code.
        A text answer (no codes), or one heard to its last code, is kept whole.
        """
        heard = max(0, samples_played) // SAMPLES_PER_CODE
        if not self.code_idx or heard >= len(self.code_idx):
            return None
        return self.code_idx[heard - 1] + 1 if heard > 0 else self.code_idx[0]

    def last_row(self, keep: int) -> Row:
        return self.rows[keep - 1] if keep > 0 else self.prefix_last_row


@dataclass(eq=False)  # identity: an entry is found by `is` and removed by `remove`
class Item:
    """A turn of the conversation after its first system turn, in order (history.py): a client's item, an answer, or
    a system turn of new instructions (pinned: never dropped to fit the context)."""

    item_id: str | None  # None: a user audio turn not committed yet, or new instructions
    pinned: bool = False


UndoKind = Literal["clear", "requeue", "close", "reopen"]


@dataclass
class Tentative:
    """A tentative commit (CommitUserAudio.tentative) not yet confirmed or withdrawn."""

    turn: Turn  # the user turn it closed
    end_row: int  # conversation rows up to the user's last code: a withdrawal truncates back to here
    response_id: str | None = None  # the answer to it, once asked for
    answer_item: str | None = None  # that answer's item id in Session.items
    answer_before: Answer | None = None  # Session.answer when the answer was asked for: it stands again if withdrawn
    truncate: TruncateResponse | None = None  # a cut of answer_before that came while the withdrawal was stopping
    item: Item | None = None  # the turn's entry in Session.items: the open audio turn again if withdrawn
    # Rows that went in after the turn with its answer (items added while the user spoke): due again if withdrawn
    after_rows: list[Row] = field(default_factory=list)
    transcript: tuple[str, list[int]] | None = None  # (item id, codes) to transcribe once the turn stands


@dataclass
class Turn:
    """The session's live engine request."""

    request_id: str
    base_rows: int  # conversation rows before this request
    params: SamplingParams
    close_rows: list[Row]  # the previous answer's closing rows this request carries first
    carried_rows: list[Row]  # queued turns (text, committed audio) it carries after them
    system_included: bool
    codes: list[int] = field(default_factory=list)  # user speech codes sent
    audio_open: bool = False  # user audio span started and not yet committed
    committed: bool = False
    rows_added: int = 0
    rerun_rows: int = 0  # history rows never run yet (the previous answer's last sampled row): prefilled with this turn
    user_rows_start: int = 0  # rows before the user speech turn in this request
    user_end: int = 0  # rows of this request (from base_rows) up to the user's last code, once committed
    response: ResponseState | None = None
    undo: UndoKind | None = None  # abort in flight to undo this turn
    cut_rows: int | None = None  # with undo: truncate the conversation here instead of base_rows
    cut_last_row: Row | None = None


@dataclass
class Session:
    session_id: str
    owner: bytes  # the client (ZeroMQ identity) that opened it; every reply goes there
    instructions: str | None = None
    voice_wav: bytes | None = None
    voice: Any = None  # the decoder's speaker prompt made from voice_wav (None: the codec's default)
    voice_job: int = 0  # prompts submitted to the voice worker; only the latest one's result counts
    voice_waiting: bool = False  # that prompt is still being made: responses wait for it (in `deferred`)
    sampling: SamplingParams | None = None  # last used; incremental prefill opens requests with it
    system_sent: bool = False
    close_rows: list[Row] = field(default_factory=list)
    pending_rows: list[Row] = field(default_factory=list)
    pending_codes: list[int] = field(default_factory=list)
    pending_commit: bool = False  # commit received for codes still in pending_codes
    # A commit the encoder is finalizing: (client, CommitUserAudio); the session's messages after it wait in
    # after_commit until its last codes are in.
    commit_pending: tuple[bytes, Any] | None = None
    after_commit: list[tuple[bytes, Any]] = field(default_factory=list)
    commit_at: float | None = None  # time.monotonic() of the last commit's arrival, until an answer marks it
    commit_call_at: float | None = None  # ... of the start of the encoder call that finalized it
    commit_done_at: float | None = None  # ... and of its last codes
    turn_codes: int = 0  # speech codes of the current user turn (progress reports)
    active: Turn | None = None
    answer: Answer | None = None  # the latest finished response, if nothing followed it yet
    moved_answer: str | None = None  # the latest answer's response id once its rows moved (a cut before it)
    deferred: list[CreateResponse] = field(default_factory=list)  # waiting for an undo or a completion
    # A finished answer whose last audio is still being decoded on the codec worker: its ResponseDone
    # (and any response asked for meanwhile) waits for it.
    completing: ResponseState | None = None
    tentative: Tentative | None = None
    # A withdrawn turn, open again: the conversation ends with its audio rows and its next codes extend it (a new
    # engine request that carries this turn's bookkeeping on).
    reopened: Turn | None = None
    next_request: int = 0
    items: list[Item] = field(default_factory=list)  # one per turn after the system turn (history.py)
    audio_item: Item | None = None  # the user audio turn in the history, until its commit names it
    commit_item: str | None = None  # the item id of the commit being applied
    turn_code_list: list[int] = field(default_factory=list)  # the current user turn's codes (its transcription)
    # Drop the oldest items when the next turn would not fit, until the history takes at most this share of the
    # context (None: refuse the turn instead; SetTruncation).
    retention: float | None = AUTO_RETENTION
    refill_rows: int = 0  # the leading pending rows are history prefilled again (after a cut): background work

    @property
    def conversation_id(self) -> str:
        return self.session_id

    def new_request_id(self) -> str:
        self.next_request += 1
        return f"{self.session_id}#{self.next_request}"
