"""Voice prompts made off the engine loop: a WAV file's bytes -> the decoder's speaker prompt (resampling, speech
codes, x-vector, prompt mel), on a thread of its own at a low scheduling priority.

A prompt of 30 s costs a few hundred ms of encoder and CPU work; on the loop every other session's steps and audio
would wait for it. The loop hands a prompt over (`submit`) and collects what is ready (`take_results`, each with the
exception of a recording that could not be used instead of a voice); the session's own answers wait for it meanwhile
(Service). Prompts are made one at a time, in the order submitted; a prompt submitted again for a key replaces the
one still waiting (only the latest of a session counts).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("engines.process")

NICE = 10  # the thread's scheduling priority below the loop's (Linux: per thread)


@dataclass(frozen=True)
class VoiceResult:
    key: str
    job: int  # the number `submit` was given: the loop keeps only its latest job's result
    voice: Any | Exception
    wav: bytes


class VoiceWorker:
    """`load`: WAV bytes -> a voice (raises for a recording it cannot use)."""

    def __init__(self, load: Callable[[bytes], Any]) -> None:
        self._load = load
        self._cv = threading.Condition()
        self._waiting: dict[str, tuple[int, bytes]] = {}  # key -> (job, wav), in submission order
        self._results: deque[VoiceResult] = deque()
        self._running = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="voice-worker", daemon=True)
        self._thread.start()

    def submit(self, key: str, job: int, wav: bytes) -> None:
        with self._cv:
            self._waiting.pop(key, None)
            self._waiting[key] = (job, wav)
            self._cv.notify_all()

    def drop(self, key: str) -> None:
        """Forget this key's waiting prompt and results (its session closed); one in the making is dropped when done
        by the loop, whose session is gone."""
        with self._cv:
            self._waiting.pop(key, None)
            self._results = deque(r for r in self._results if r.key != key)

    def take_results(self) -> list[VoiceResult]:
        with self._cv:
            out = list(self._results)
            self._results.clear()
            return out

    def busy(self) -> bool:
        """A prompt waiting or in the making, or results not yet collected."""
        with self._cv:
            return self._running or bool(self._waiting) or bool(self._results)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: the prompt still goes off the loop
            pass
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._waiting)
                if self._closed:
                    return
                key = next(iter(self._waiting))
                job, wav = self._waiting.pop(key)
                self._running = True
            try:
                voice: Any | Exception = self._load(wav)
            except Exception as e:  # noqa: BLE001 - handed back: the loop tells the session its prompt failed
                voice = e
            with self._cv:
                self._results.append(VoiceResult(key, job, voice, wav))
                self._running = False
                self._cv.notify_all()
