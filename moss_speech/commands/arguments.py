"""Argument types the commands share: a bad value is argparse's usage error (exit 2), not a traceback."""

from __future__ import annotations

from engines.process.options import int_at_least

positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def counts(text: str) -> list[int]:
    """Comma-separated counts, each >= 1 (batch sizes, sessions): "1,16,64" -> [1, 16, 64]."""
    return [positive_int(x.strip()) for x in text.split(",")]
