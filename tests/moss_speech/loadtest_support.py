"""Shared by the load test's tests: a mono 16-bit WAV writer and a turn record with plausible defaults."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from moss_speech.loadtest.results import TurnRecord


def _write_wav(path: Path, x: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.clip(x * 32767, -32768, 32767).astype("<i2").tobytes())
    return path


def _rec(session: int, turn: int, **kw) -> TurnRecord:
    base = dict(status="ok", ttfa_ms=100.0 + session, ttfa_commit_ms=90.0, response_status="completed",
                audio_s=1.6, deltas=4, gaps_ms=[20.0, 30.0, 40.0], rtf=0.5)
    base.update(kw)
    return TurnRecord(session=session, turn=turn, **base)
