"""A stand-in end-of-turn model whose answer the test chooses, and the speech sample's voice without its silences."""

from __future__ import annotations

import threading

import numpy as np

from server.audio.pcm import read_wav
from tests.paths import DATA

WAV = DATA / "speech_en_16k.wav"


class Model:
    """Answers P(complete) = `p` for every turn."""

    def __init__(self, p: float) -> None:
        self.p = p
        self.calls: list[int] = []  # samples heard per call

    def complete(self, turns: list[np.ndarray]) -> list[float]:
        self.calls += [len(a) for a in turns]
        return [self.p] * len(turns)


class HeldModel(Model):
    """A Model whose every answer waits until the test releases it (`release.set()`); `started` is set once it
    has a call in hand."""

    def __init__(self, p: float) -> None:
        super().__init__(p)
        self.started = threading.Event()
        self.release = threading.Event()

    def complete(self, turns: list[np.ndarray]) -> list[float]:
        self.started.set()
        assert self.release.wait(30), "the test never released the model"
        return super().complete(turns)


def voice24k() -> np.ndarray:
    """The sample's voice, without the file's leading and trailing silence."""
    x, _ = read_wav(WAV, target_rate=24000)
    loud = np.flatnonzero(np.abs(x) > 0.02)
    return x[loud[0]:loud[-1] + 1]
