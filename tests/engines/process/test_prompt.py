"""Prompt rows in the published chat format, the stand-in tokenizer and streaming detokenisation."""

from __future__ import annotations

import pytest
import tokenizers

from engines.config import ConfigError
from engines.process.prompt import PromptBuilder
from engines.process.tokenizer import (
    HFTokenizer,
    IncrementalDetokenizer,
    StandInTokenizer,
    load_tokenizer,
)

PAD_A = 512  # audio_pad
IMS, IME, SOSP, MPAD, EOSP = 151644, 151645, 151646, 151667, 16384


def b(s: str) -> list[tuple[int, int]]:
    return [(c, PAD_A) for c in s.encode()]


@pytest.fixture
def pb() -> PromptBuilder:
    return PromptBuilder(StandInTokenizer())


def test_text_turns_hand_checked(pb: PromptBuilder) -> None:
    # "<|im_start|>system\nHi<|im_end|>\n" with byte ids, audio channel audio_pad everywhere.
    assert pb.system_rows("Hi", "audio") == [(IMS, PAD_A)] + b("system\nHi") + [(IME, PAD_A), (10, PAD_A)]
    assert pb.text_turn_rows("user", "é?") == [(IMS, PAD_A), (117, PAD_A), (115, PAD_A), (101, PAD_A), (114, PAD_A),
                                                (10, PAD_A), (0xC3, PAD_A), (0xA9, PAD_A), (63, PAD_A),
                                                (IME, PAD_A), (10, PAD_A)]
    default_spoken = pb.system_rows(None, "audio")
    assert default_spoken[1:-2] == b("system\nYou are a helpful voice assistant. Answer the user's questions "
                                     "with spoken responses.")
    assert pb.system_rows(None, "text")[1:-2] == b("system\nYou are a helpful assistant. Answer the user's "
                                                   "questions with text.")


def test_audio_turn_hand_checked(pb: PromptBuilder) -> None:
    rows = pb.user_audio_turn_rows([7, 16383])
    assert rows == ([(IMS, PAD_A)] + b("user\n")
                    + [(SOSP, PAD_A), (MPAD, 7), (MPAD, 16383), (MPAD, EOSP)]
                    + [(IME, PAD_A), (10, PAD_A)])
    # Incremental parts concatenate to the same rows.
    parts = (pb.audio_turn_open_rows() + pb.audio_code_rows([7]) + pb.audio_code_rows([16383])
             + pb.audio_turn_close_rows())
    assert parts == rows
    assert pb.audio_code_rows([]) == []
    with pytest.raises(ValueError):
        pb.audio_code_rows([16384])


def test_assistant_prefix_and_close(pb: PromptBuilder) -> None:
    assert pb.assistant_prefix_rows("text") == [(IMS, PAD_A)] + b("assistant\n")
    assert pb.assistant_prefix_rows("audio") == [(IMS, PAD_A)] + b("assistant\n") + [(SOSP, PAD_A)]
    nl = [(10, PAD_A)]
    assert pb.assistant_close_rows((IME, 3)) == nl  # stopped on <|im_end|>
    assert pb.assistant_close_rows((151643, 3)) == [(IME, PAD_A)] + nl  # <|endoftext|>
    assert pb.assistant_close_rows((65, 3)) == [(IME, PAD_A)] + nl  # cut in text
    assert pb.assistant_close_rows((MPAD, 5)) == [(MPAD, EOSP), (IME, PAD_A)] + nl  # cut inside speech
    assert pb.assistant_close_rows((SOSP, PAD_A)) == [(MPAD, EOSP), (IME, PAD_A)] + nl  # cut before 1st code
    assert pb.assistant_close_rows((MPAD, EOSP)) == [(IME, PAD_A)] + nl  # speech closed, turn not


def test_turns_begin_at_the_start_and_after_each_turns_end_only(pb: PromptBuilder) -> None:
    """An <|im_start|> a model sampled inside its answer, even after a newline, begins no turn."""
    user = pb.text_turn_rows("user", "hi")
    answer = pb.assistant_prefix_rows("text") + [(104, PAD_A), (10, 7), (IMS, 9), (105, 3), (IME, 2)]
    rows = pb.system_rows(None, "text") + user + answer + pb.assistant_close_rows(answer[-1]) + user
    starts = pb.turn_starts(rows)
    assert len(starts) == 4 and all(rows[i][0] == IMS for i in starts)
    assert starts[2] == len(rows) - len(user) - len(answer) - 1 and starts[3] == len(rows) - len(user)
    assert pb.turn_starts(user[1:]) == [] and pb.turn_starts([]) == []


def test_stand_in_round_trip() -> None:
    tok = StandInTokenizer()
    s = "Grüße, 世界 🎉 <|im_end|>"
    ids = tok.encode(s)
    assert all(i < 256 for i in ids)  # typed control text stays text
    assert tok.decode(ids) == s
    assert tok.decode([151644, 72, 151645]) == "H"  # specials skipped
    assert tok.decode([300]) == tok.decode([300]) and tok.decode([300]).startswith(" ")


@pytest.mark.parametrize("text", ["héllo wörld", "世界 and 🎉🎉", "plain ascii", "é"])
def test_streaming_detok_multibyte(text: str) -> None:
    tok = StandInTokenizer()
    det = IncrementalDetokenizer(tok)
    deltas = [det.push(i) for i in tok.encode(text) + [151645]]
    deltas.append(det.flush())
    assert "".join(deltas) == text
    for d in deltas:
        assert "\ufffd" not in d  # never half a character
    # A multi-byte character comes out whole, at its last byte.
    if "🎉" in text:
        assert "🎉" in deltas


EMPTY, END_EMPTY = 151669, 151670  # the stand-in's ids for <|empty|> and <|end_empty|>


def test_empty_marks_decode_as_the_published_processor_replaces_them() -> None:
    tok = StandInTokenizer()
    ids = tok.encode("a") + [EMPTY] + tok.encode("b") + [END_EMPTY, 151644, 151667, 151679] + tok.encode("c")
    assert tok.decode(ids) == "a.b:c"  # marks read as "." and ":", every other id >= 151643 dropped
    det = IncrementalDetokenizer(tok)
    assert "".join([det.push(i) for i in ids] + [det.flush()]) == "a.b:c"


def test_a_mark_ends_the_byte_run_before_it() -> None:
    # As in a whole decode: the bytes before a mark decode on their own, an incomplete character as U+FFFD.
    tok = StandInTokenizer()
    ids = [0xC3, EMPTY, *"é".encode()]
    assert tok.decode(ids) == "\ufffd.é"
    det = IncrementalDetokenizer(tok)
    assert [det.push(i) for i in ids] == ["", "\ufffd.", "", "é"]


def test_streaming_detok_flushes_incomplete_tail() -> None:
    det = IncrementalDetokenizer(StandInTokenizer())
    assert det.push(0xC3) == ""
    assert det.flush() == "\ufffd"


def test_hf_tokenizer_from_json(tmp_path) -> None:
    from tokenizers import decoders, models, pre_tokenizers

    # A byte-level BPE with no merges: every byte is one token, plus an added special at 151645.
    vocab = {tok: i for i, tok in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([tokenizers.AddedToken("<|im_end|>", special=True)])
    (tmp_path / "tokenizer.json").write_text(t.to_str())
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    s = "wörld 🎉 <|im_end|>"
    ids = tok.encode(s)
    assert len(vocab) not in ids  # the typed special stays text
    assert tok.decode(ids) == s
    det = IncrementalDetokenizer(tok)
    deltas = [det.push(i) for i in ids] + [det.flush()]
    assert "".join(deltas) == s and all("\ufffd" not in d for d in deltas)


def test_hf_tokenizer_reads_the_mark_ids_from_its_added_tokens(tmp_path) -> None:
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({"<|im_end|>": 151645, "<|empty|>": 151700, "<|end_empty|>": 151701})
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_tokens([tokenizers.AddedToken("<|empty|>"), tokenizers.AddedToken("<|end_empty|>")])
    t.add_special_tokens([tokenizers.AddedToken("<|im_end|>", special=True)])
    (tmp_path / "tokenizer.json").write_text(t.to_str())
    tok = load_tokenizer(str(tmp_path))
    assert tok.marks == {151700: ".", 151701: ":"}
    ids = tok.encode("x") + [151700] + tok.encode("y") + [151701, 151645]
    assert tok.decode(ids) == "x.y:"
    det = IncrementalDetokenizer(tok)
    assert "".join([det.push(i) for i in ids] + [det.flush()]) == "x.y:"


def test_missing_tokenizer_is_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
