"""The prompt builder against the official processor's rows for public fixtures (tests/data/golden_prompt_rows.json
names their source): text-to-text, text-to-speech and speech-to-speech, row for row."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from engines.process.prompt import PromptBuilder
from engines.tokens import SPOKEN_SYSTEM_PROMPT, TEXT_SYSTEM_PROMPT
from tests.paths import DATA

GOLDEN = json.loads((DATA / "golden_prompt_rows.json").read_text())


class PieceTokenizer:
    """The published tokenizer's ids for the exact pieces the processor tokenizes, and nothing else: a piece the
    processor never tokenizes on its own (say `user\\nHello` in one call) is a KeyError."""

    marks: dict[int, str] = {}

    def __init__(self, pieces: list[list]) -> None:
        self.pieces = {text: ids for text, ids in pieces}

    def encode(self, text: str) -> list[int]:
        return list(self.pieces[text])

    def decode(self, ids: Sequence[int]) -> str:
        raise AssertionError("the prompt builder never decodes")


@pytest.fixture
def pb() -> PromptBuilder:
    return PromptBuilder(PieceTokenizer(GOLDEN["segments"]))


def _rows(rows: list[list[int]]) -> list[tuple[int, int]]:
    return [tuple(r) for r in rows]


def test_the_golden_file_names_its_source():
    src = GOLDEN["source"]
    assert src["repository"].startswith("https://github.com/") and len(src["commit"]) == 40
    assert set(GOLDEN["cases"]) == {"t2t_short", "t2s_cn", "s2s_cn"}


@pytest.mark.parametrize("case", ["t2t_short", "t2s_cn"])
def test_text_turn_rows_equal_the_processor(pb, case):
    c = GOLDEN["cases"][case]
    rows = (pb.system_rows(c["system"], c["output_modality"]) + pb.text_turn_rows("user", c["user_text"])
            + pb.assistant_prefix_rows(c["output_modality"]))
    assert rows == _rows(c["rows"])


def test_audio_turn_rows_equal_the_processor(pb):
    c = GOLDEN["cases"]["s2s_cn"]
    assert len(c["user_codes"]) == 343
    rows = (pb.system_rows(c["system"], "audio") + pb.user_audio_turn_rows(c["user_codes"])
            + pb.assistant_prefix_rows("audio"))
    assert rows == _rows(c["rows"])
    # Incremental prefill builds the same turn in three parts.
    parts = (pb.audio_turn_open_rows() + pb.audio_code_rows(c["user_codes"]) + pb.audio_turn_close_rows())
    assert pb.system_rows(c["system"], "audio") + parts + pb.assistant_prefix_rows("audio") == _rows(c["rows"])


def test_default_system_prompts_are_the_fixtures_system_turns(pb):
    # The official demo passes these as the system turn; the server's default turn is the same text.
    assert pb.system_rows(None, "text") == _rows(GOLDEN["cases"]["t2t_short"]["rows"][:19])
    assert pb.system_rows(None, "audio") == _rows(GOLDEN["cases"]["t2s_cn"]["rows"][:21])
    assert GOLDEN["cases"]["t2t_short"]["system"] == TEXT_SYSTEM_PROMPT
    assert GOLDEN["cases"]["s2s_cn"]["system"] == SPOKEN_SYSTEM_PROMPT
