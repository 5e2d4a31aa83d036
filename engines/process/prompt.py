"""Qwen chat prompt rows in the published model's chat format, built by hand, turn by turn.

A text turn is `<|im_start|>{role}\\n{content}<|im_end|>\\n`, tokenized in the published processor's pieces:
`{role}\\n`, then `{content}` on its own (no BPE merge crosses into the content), then `\\n` after `<|im_end|>`.
A user audio turn is `<|im_start|>user\\n` + the audio span rows + `<|im_end|>\\n`; the span of n
codes is `(sosp, audio_pad)`, `(modality_pad, c_i)` x n, `(modality_pad, eosp)`. For incremental
prefill the turn comes in three parts (`audio_turn_open_rows`, `audio_code_rows`,
`audio_turn_close_rows`) whose concatenation equals `user_audio_turn_rows`.

The assistant prefix is `<|im_start|>assistant\\n`, plus `<|object_ref_start|>` (= sosp) for a
spoken answer. After an answer, `assistant_close_rows` gives the rows that make the history
well-formed again before the next turn (see its docstring).
"""

from __future__ import annotations

from typing import Literal

from engines.process.tokenizer import TextTokenizer
from engines.tokens import (
    AUDIO_PAD,
    EOSP,
    IM_END,
    IM_START,
    MODALITY_PAD,
    OBJECT_REF_START,
    SOSP,
    SPOKEN_SYSTEM_PROMPT,
    TEXT_SYSTEM_PROMPT,
    Row,
    audio_span_rows,
    text_rows,
)

Modality = Literal["audio", "text"]
Role = Literal["system", "user", "assistant"]


def default_system_prompt(modality: Modality) -> str:
    return SPOKEN_SYSTEM_PROMPT if modality == "audio" else TEXT_SYSTEM_PROMPT


def audio_span_open(row: Row) -> bool:
    """True when the history ending in `row` is inside an audio span (its eosp row is still due)."""
    text, audio = row
    return text == SOSP or (text == MODALITY_PAD and audio != EOSP)


class PromptBuilder:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self._newline = text_rows(tokenizer.encode("\n"))

    def _header(self, role: Role) -> list[Row]:
        return text_rows([IM_START] + self.tokenizer.encode(f"{role}\n"))

    def _end(self) -> list[Row]:
        return [(IM_END, AUDIO_PAD)] + self._newline

    def text_turn_rows(self, role: Role, content: str) -> list[Row]:
        return self._header(role) + text_rows(self.tokenizer.encode(content)) + self._end()

    def system_rows(self, instructions: str | None, modality: Modality) -> list[Row]:
        """The system turn; None means the contract's default prompt for the answer modality."""
        return self.text_turn_rows("system", default_system_prompt(modality) if instructions is None else instructions)

    def audio_turn_open_rows(self) -> list[Row]:
        return self._header("user") + [(SOSP, AUDIO_PAD)]

    @staticmethod
    def audio_code_rows(codes: list[int]) -> list[Row]:
        return audio_span_rows(codes)[1:-1]

    def audio_turn_close_rows(self) -> list[Row]:
        return [(MODALITY_PAD, EOSP)] + self._end()

    def user_audio_turn_rows(self, codes: list[int]) -> list[Row]:
        return self._header("user") + audio_span_rows(codes) + self._end()

    def assistant_prefix_rows(self, modality: Modality) -> list[Row]:
        rows = self._header("assistant")
        if modality == "audio":
            rows.append((OBJECT_REF_START, AUDIO_PAD))  # acts as sosp: generation starts in audio mode
        return rows

    def assistant_close_rows(self, last_row: Row) -> list[Row]:
        """Rows that close an assistant turn whose history ends in `last_row`.

        An open audio span (the answer stopped or was cut between sosp and eosp) gets its
        `(modality_pad, eosp)` row; a turn not already ended by `<|im_end|>` gets `<|im_end|>`
        (also after `<|endoftext|>`); then the `\\n` that follows every turn.
        """
        rows: list[Row] = []
        if audio_span_open(last_row):
            rows.append((MODALITY_PAD, EOSP))
        if last_row[0] != IM_END or rows:
            rows.append((IM_END, AUDIO_PAD))
        return rows + self._newline

    def turn_starts(self, rows: list[Row]) -> list[int]:
        """Where the turns of a history begin: its first row if that is `<|im_start|>`, and every `<|im_start|>` right
        after a turn's end (`<|im_end|>` and the newline, on the text channel). One that a model sampled inside its
        answer begins none: generation stops at `<|im_end|>`, so no answer holds a turn's end before it."""
        end = [t for t, _ in self._end()]
        k = len(end)
        return [i for i, (t, _) in enumerate(rows) if t == IM_START
                and (i == 0 or (i >= k and [r[0] for r in rows[i - k:i]] == end))]
