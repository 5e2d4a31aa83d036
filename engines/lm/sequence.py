"""State of one request (and of a conversation's cached history) inside the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.api import FinishReason, Mode, SamplingParams
from engines.tokens import EOSP, SOSP, Row, start_mode


def blocks_for(rows: int, block_size: int) -> int:
    return -(-rows // block_size)


def _mode_before_forward(mode: Mode, last: Row) -> Mode:
    """The published generation rule: before each forward, sosp in text mode enters audio; eosp in audio mode leaves
    it."""
    text, audio = last
    if mode == "text" and text == SOSP:
        return "audio"
    if mode == "audio" and audio == EOSP:
        return "text"
    return mode


@dataclass(eq=False)  # identity semantics: lists of live objects are searched by `in`
class Conversation:
    """Rows and KV blocks kept between turns; rows[:num_computed] have KV in `block_ids`."""

    conversation_id: str
    rows: list[Row] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    busy: bool = False  # a live request is extending it


@dataclass(eq=False)
class Sequence:
    request_id: str
    params: SamplingParams
    seed: int
    rows: list[Row]  # the whole history: cached turns + this prompt + generated rows
    num_computed: int  # rows whose KV is written
    block_ids: list[int]
    prompt_len: int  # rows before the first generated one (grows while input is open)
    reserved_blocks: int = 0  # reservation not yet turned into blocks
    input_done: bool = True
    conversation: Conversation | None = None
    slot: int = -1  # row in the per-sequence device buffers (repetition history)
    num_generated: int = 0
    mode: Mode = "text"
    finish_reason: FinishReason | None = None
    arrival: int = 0  # admission order
    history_marked: bool = False  # the runner has loaded this sequence's history into its repetition buffers
    # Background work (Scheduler): rows before this index are run only with what a step has left, and never beside
    # an answer's first rows. A background request (an input transcription) has it past any row it will reach; a
    # conversation cut to fit its context re-runs the rows it kept up to here.
    low_until: int = 0
    background_request: bool = False  # admitted only when no other request waits (Scheduler)
    # Its answer's first rows, each of which its first audio waits on (the request's, else EngineConfig.ramp_rows):
    # the steps that sample them are kept short (Scheduler).
    ramp_rows: int = 0

    @property
    def background(self) -> bool:
        """Its next rows are background work."""
        return self.num_computed < self.low_until

    @property
    def num_pending(self) -> int:
        return len(self.rows) - self.num_computed

    @property
    def generating(self) -> bool:
        """Prompt complete: each step runs exactly the last generated row."""
        return self.input_done and self.num_generated > 0

    def blocks_needed(self, block_size: int) -> int:
        """Blocks this sequence may still need beyond what it holds (history + prompt + output budget)."""
        remaining_out = self.params.max_new_tokens - self.num_generated
        total = len(self.rows) + remaining_out
        return max(0, blocks_for(total, block_size) - len(self.block_ids))

    def update_mode(self) -> None:
        self.mode = _mode_before_forward(self.mode, self.rows[-1])

    def first_mode(self) -> Mode:
        """The mode of the first generated row, from the last prompt row (`start_mode`): what `start` sets."""
        return _mode_before_forward(start_mode(self.rows[-1]), self.rows[-1])

    def start(self) -> None:
        """Mode from the last prompt row (`start_mode`), then the before-forward rule."""
        self.mode = self.first_mode()

    def sampling_mode(self) -> Mode:
        """The mode of the row the next forward samples (before the first row: `first_mode`)."""
        return self.mode if self.num_generated else self.first_mode()

