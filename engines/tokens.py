"""Special token ids and the row rules of the published model.

A row is one grid position: (text-channel token, audio-channel token).
"""

from __future__ import annotations

from typing import Literal

# Text channel.
ENDOFTEXT = 151643
IM_START = 151644
IM_END = 151645
SOSP = 151646  # start of speech
OBJECT_REF_START = 151646  # `<|object_ref_start|>` is the same id as sosp in Qwen's vocabulary
MODALITY_PAD = 151667

# Audio channel.
AUDIO_PAD = 512  # placeholder audio token in text rows
EOSP = 16384  # end of speech
NUM_AUDIO_CODES = 16384  # codes 0..16383 are speech; ids >= 16385 are never sampled
AUDIO_SAMPLEABLE = EOSP + 1

TEXT_STOP_TOKENS = (ENDOFTEXT, IM_END)

# Added tokens whose text the published processor replaces after decoding the text channel.
TEXT_MARKS = {"<|empty|>": ".", "<|end_empty|>": ":"}
# The stand-in tokenizers' ids for them (free ids above modality_pad); a checkpoint's tokenizer.json names its own.
STAND_IN_MARKS = {151669: "<|empty|>", 151670: "<|end_empty|>"}

SPOKEN_SYSTEM_PROMPT = (
    "You are a helpful voice assistant. Answer the user's questions with spoken responses."
)
TEXT_SYSTEM_PROMPT = "You are a helpful assistant. Answer the user's questions with text."

Row = tuple[int, int]


def text_rows(token_ids: list[int]) -> list[Row]:
    """Rows for text tokens: the audio channel holds audio_pad."""
    return [(t, AUDIO_PAD) for t in token_ids]


def audio_span_rows(codes: list[int]) -> list[Row]:
    """An audio span of n codes is n+2 rows: text `sosp, pad x (n+1)`; audio `pad, c1..cn, eosp`."""
    for c in codes:
        if not 0 <= c < NUM_AUDIO_CODES:
            raise ValueError(f"audio code {c} outside [0, {NUM_AUDIO_CODES})")
    rows: list[Row] = [(SOSP, AUDIO_PAD)]
    rows += [(MODALITY_PAD, c) for c in codes]
    rows.append((MODALITY_PAD, EOSP))
    return rows


def start_mode(last_row: Row) -> Literal["audio", "text"]:
    """Generation mode from the last prompt row, as the published generate loop sets it: modality_pad in the text
    channel means audio, then audio_pad in the audio channel means text, so the tie `(modality_pad, audio_pad)` is
    text."""
    text, audio = last_row
    return "audio" if text == MODALITY_PAD and audio != AUDIO_PAD else "text"
