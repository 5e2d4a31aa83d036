"""Bounds on what one session may hand the engine, so that no client can make work or memory grow without end:
the length of a text (instructions, a text item), the rows of items waiting to go in with the next answer (a
history restored item by item), and an answer's length (its KV is reserved whole when it is admitted). Past a
bound the message is refused with `input_too_large` before any of its work is done; the session goes on."""

from __future__ import annotations

from dataclasses import dataclass

from engines.config import ConfigError
from engines.process.errors import ServiceError
from engines.process.options import MAX_OUTPUT_TOKENS, MAX_TEXT_CHARS
from engines.protocol import errors


@dataclass(frozen=True)
class InputLimits:
    max_text_chars: int = MAX_TEXT_CHARS
    max_output_tokens: int = MAX_OUTPUT_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_text_chars", "max_output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"InputLimits.{name} must be an int >= 1, got {v!r}")

    def check_text(self, what: str, text: str | None) -> None:
        if text is not None and len(text) > self.max_text_chars:
            raise ServiceError(errors.INPUT_TOO_LARGE, f"{what} of {len(text)} characters is over the engine's bound "
                               f"of {self.max_text_chars} (--max-text-chars)")

    def check_output(self, max_new_tokens: int, response_id: str | None = None) -> None:
        if max_new_tokens > self.max_output_tokens:
            raise ServiceError(errors.INPUT_TOO_LARGE, f"max_output_tokens {max_new_tokens} is over the engine's "
                               f"bound of {self.max_output_tokens} (--max-output-tokens)", response_id)

    @staticmethod
    def check_waiting_rows(rows: int, max_model_len: int) -> None:
        """Rows waiting in the session for the next answer (items created since the last one, with the closing rows
        of the answer before them): more than the model's context could never go in one request."""
        if rows > max_model_len:
            raise ServiceError(errors.INPUT_TOO_LARGE, f"the items waiting for the next answer would hold {rows} rows, "
                               f"more than the model's context of {max_model_len} (--max-model-len): create a "
                               "response to send those already added")
