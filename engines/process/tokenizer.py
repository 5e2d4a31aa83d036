"""Text tokenizers for prompts and answers, and incremental detokenisation.

Two implementations share one small interface (`encode(text) -> ids`, `decode(ids) -> str`):
- `HFTokenizer`: the checkpoint's `tokenizer.json` (Qwen byte-level BPE) loaded with the
  `tokenizers` package, imported lazily so the engine runs without it on tiny models.
- `StandInTokenizer`: for the random presets. Ids 0..255 are single bytes (so any text round-trips
  and multi-byte UTF-8 characters span several tokens, as in byte-level BPE); other ordinary ids
  decode to deterministic pseudo-words, so a random model's text is readable noise; ids from
  `<|endoftext|>` (151643) up are the special tokens, with the real ids of engines/tokens.py.

`encode` never produces special ids from text: a user who types "<|im_end|>" gets those characters,
not the control token (the prompt builder inserts control tokens by id). `decode` follows the
published processor's text decode: `<|empty|>` reads as "." and `<|end_empty|>` as ":" (each
tokenizer's `marks`, by id), every other special id is skipped, and an incomplete UTF-8 sequence
reads as U+FFFD; `IncrementalDetokenizer` uses that to emit only complete characters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from engines.config import PRESETS, ConfigError
from engines.tokens import ENDOFTEXT, STAND_IN_MARKS, TEXT_MARKS

FIRST_SPECIAL_ID = ENDOFTEXT  # Qwen's added tokens all have ids >= <|endoftext|>
REPLACEMENT_CHAR = "\ufffd"

# Special tokens the stand-in recognises by name (real Qwen ids).
STAND_IN_SPECIALS = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
}

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables


class TextTokenizer(Protocol):
    marks: Mapping[int, str]  # special ids that decode to text (the rest decode to nothing)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _runs(ids: Sequence[int], marks: Mapping[int, str]) -> Iterator[list[int] | str]:
    """Ordinary ids in runs, a mark's text alone; other special ids dropped."""
    run: list[int] = []
    for i in ids:
        if i < FIRST_SPECIAL_ID:
            run.append(i)
        elif i in marks:
            if run:
                yield run
                run = []
            yield marks[i]
    if run:
        yield run


class StandInTokenizer:
    """Byte-level stand-in with the real special ids (see module docstring)."""

    marks: Mapping[int, str] = {i: TEXT_MARKS[name] for i, name in STAND_IN_MARKS.items()}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(r if isinstance(r, str) else self.decode_bytes(r).decode("utf-8", errors="replace")
                       for r in _runs(ids, self.marks))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        out = bytearray()
        for i in ids:
            if i < 0:
                raise ValueError(f"token id {i} is negative")
            if i < 256:
                out.append(i)
            elif i < FIRST_SPECIAL_ID:
                out += self._word(i)
            # special ids are skipped
        return bytes(out)

    @staticmethod
    def _word(i: int) -> bytes:
        # A space and two or three syllables, fixed per id.
        n = i - 256
        parts = [_SYLLABLES[n % 70], _SYLLABLES[(n // 70) % 70]]
        if n >= 70 * 70:
            parts.append(_SYLLABLES[(n // 4900) % 70])
        return (" " + "".join(parts)).encode()


class HFTokenizer:
    """A checkpoint's `tokenizer.json`, via the `tokenizers` package."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"no tokenizer.json at {file}")
        try:
            from tokenizers import Tokenizer  # lazy: only real checkpoints need it
        except ImportError:
            raise ConfigError("loading tokenizer.json needs the `tokenizers` package") from None
        self._tok = Tokenizer.from_file(str(file))
        # Text such as "<|im_end|>" typed by a user must stay text, never a control token.
        self._tok.encode_special_tokens = True
        self.marks: Mapping[int, str] = {i: text for name, text in TEXT_MARKS.items()
                                         if (i := self._tok.token_to_id(name)) is not None}

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(r if isinstance(r, str) else self._tok.decode(r, skip_special_tokens=True)
                       for r in _runs(ids, self.marks))


def load_tokenizer(name_or_path: str) -> TextTokenizer:
    """`tiny-random` / `full-random` -> stand-in; a checkpoint dir -> its tokenizer.json."""
    if name_or_path in PRESETS:
        return StandInTokenizer()
    return HFTokenizer(name_or_path)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that are always whole UTF-8 characters.

    Decodes a short window of recent ids twice (without and with the new ids) and emits the
    difference once it no longer ends in U+FFFD, i.e. once a multi-byte character is complete.
    Byte-level BPE merges never cross the window start, so the window keeps decoding stable.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here were emitted

    def push(self, token_id: int) -> str:
        if token_id >= FIRST_SPECIAL_ID:
            # A mark ends the byte run before it, as in a whole decode: what is held comes out first.
            return self.flush() + self._tok.marks[token_id] if token_id in self._tok.marks else ""
        self._ids.append(token_id)
        done = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) > len(done) and not text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        done = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(done):] if len(text) > len(done) else ""
