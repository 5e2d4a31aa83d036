"""Argument types the commands share: a bad value is argparse's usage error (exit 2), not a traceback."""

from __future__ import annotations

import argparse


def _int(text: str, least: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)


def counts(text: str) -> list[int]:
    """Comma-separated counts, each >= 1 (batch sizes, sessions): "1,16,64" -> [1, 16, 64]."""
    return [_int(x.strip(), 1) for x in text.split(",")]
