"""The decoder's prepared voices: the flow's form of each voice (`FlowModel.prepare_voice` or, for the full-context
flow, `FullContextFlow.prepare_voice`, whose prompt chunks hold pages of its cache), by name, least recent first.

Two threads use it: the engine loop opens answers' streams in a voice, the voice worker makes session voices ahead
(`warm`: a full-context voice is an encoder pass and a solve over its prompt, too long for the loop). When answers
need pages the cache lacks, voices no answer speaks in give theirs back, least recent first (never the default voice).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from engines.config import ConfigError
from engines.cuda.streams import driver_stream
from engines.speech_out.codes import validate_codes
from engines.speech_out.flow.full_context import FullContextFlow
from engines.speech_out.voice import Voice

MAX_VOICES = 32


class VoiceCache:
    """`prepare(codes, mel, xvector)` (an attribute) makes a voice's flow form; `full`: the full-context flow whose
    pages voices hold (None for the windowed flow); `default_name()`: the voice that is never dropped for room."""

    def __init__(self, prepare: Callable[..., Any], full: FullContextFlow | None, max_prompt_codes: int,
                 default_name: Callable[[], str], device: torch.device) -> None:
        self.prepare, self.full, self.max_prompt_codes = prepare, full, max_prompt_codes
        self._default_name, self.device = default_name, device
        self._voices: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._stream = None  # `warm`'s CUDA stream
        if full is not None:
            full.reclaim = self.reclaim

    def get(self, voice: Voice) -> Any:
        """The flow's form of `voice`, from the cache or made now on the calling thread."""
        with self._lock:
            pv = self._voices.get(voice.name)
            if pv is not None:
                self._voices.move_to_end(voice.name)
                return pv
        if voice.codes.shape[0] > self.max_prompt_codes:
            raise ConfigError(f"voice {voice.name}: prompt of {voice.codes.shape[0]} codes exceeds "
                              f"{self.max_prompt_codes}")
        validate_codes(voice.codes)
        made = self.prepare(voice.codes, voice.mel, voice.xvector)
        with self._lock:
            pv = self._voices.setdefault(voice.name, made)
            forget = [] if pv is made else [made]  # (another thread made it meanwhile)
            while len(self._voices) > MAX_VOICES:
                forget.append(self._voices.popitem(last=False)[1])
            for old in forget if self.full is not None else ():
                self.full.forget_voice(old)
        return pv

    def holding(self, voice: Voice, make_state: Callable[[Any], Any]) -> tuple[Any, Any]:
        """(the voice's flow form, `make_state(it)`), the state made while the cache still holds the voice (so its
        pages too: a full-context state takes its own hold on them); a voice dropped meanwhile is made again."""
        while True:
            pv = self.get(voice)
            with self._lock:
                if self._voices.get(voice.name) is pv:
                    return pv, make_state(pv)

    def warm(self, voice: Voice) -> None:
        """`get` on the calling thread (a worker, not the engine loop) and the least urgent CUDA stream, waited for:
        a stream opened in the voice later finds it ready."""
        if self.device.type != "cuda":
            self.get(voice)
            return
        if self._stream is None:
            self._stream = driver_stream(self.device)  # (one per cache: a driver stream is never freed)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self.get(voice)
        self._stream.synchronize()

    def reclaim(self, pages: int) -> None:
        """Drop voices no answer speaks in, least recent first, the default voice never, until `pages` are free."""
        with self._lock:
            for name, pv in list(self._voices.items()):
                if self.full.pages.n_free >= pages:
                    return
                if name != self._default_name() and self.full.pages.only_holder(pv.pages):
                    del self._voices[name]
                    self.full.forget_voice(pv)

    def cached(self, voice: Voice) -> bool:
        with self._lock:
            return voice.name in self._voices

    def check_idle(self) -> None:
        """Invariant, with no stream open: every page of the full-context cache is free or a cached voice's (a stream
        that ended without giving its pages back fails it)."""
        if self.full is None:
            return
        self.full.pages.check()
        with self._lock:
            held = sum(len(v.pages) for v in self._voices.values())
        if self.full.pages.n_free != self.full.pages.n_pages - held:
            raise AssertionError(f"{self.full.pages.n_pages - held - self.full.pages.n_free} pages held by no voice "
                                 f"and no open stream")
