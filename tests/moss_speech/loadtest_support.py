"""Shared by the load test's tests: a WAV file at a path they name, and a turn record with plausible defaults."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engines.audio.wav import write_wav
from moss_speech.loadtest.results import TurnRecord


def _write_wav(path: Path, x: np.ndarray, rate: int) -> Path:
    write_wav(path, x, rate)
    return path


def _rec(session: int, turn: int, **kw) -> TurnRecord:
    base = dict(status="ok", ttfa_ms=100.0 + session, ttfa_commit_ms=90.0, response_status="completed",
                audio_s=1.6, deltas=4, gaps_ms=[20.0, 30.0, 40.0], rtf=0.5)
    base.update(kw)
    return TurnRecord(session=session, turn=turn, **base)
