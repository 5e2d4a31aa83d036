"""Server VAD turns (`turn_detection: server_vad`): which input audio is the user speaking, and when a turn starts and
ends.

Silence before speech is only kept as a short prefix ring (prefix_padding_ms); from speech start the audio streams
to the engine, which encodes and prefills it while the user talks; after silence_duration_ms of silence the turn is
committed and (create_response) an answer is requested.

Barge-in: speech_started while an answer is active or still playing (interrupt_response) cancels it, drops queued
answer audio and truncates the engine history to the audio the user heard (responses.Responses.user_started_speaking).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.protocol import errors
from server.session import server_events as ev
from server.session.client_events import ProtocolError
from server.session.input_buffer import ENGINE_IN_RATE

if TYPE_CHECKING:
    from server.session.session import Session


class TurnDetector:
    def __init__(self, session: Session, vad_factory: Callable[[], Any] | None) -> None:
        self.s = session
        self._vad_factory = vad_factory
        self._vad = None  # created lazily: only server_vad sessions pay for it
        # VAD state (16 kHz)
        self._vad_pending = np.zeros(0, np.float32)  # < one VAD window not yet classified
        self._prefix: deque[np.ndarray] = deque()  # recent silence kept as prefix padding
        self.prefix_samples = 0
        self.in_speech = False
        self._silence_run = 0  # samples of silence since the last speech window
        self._vad_pos = 0  # 16 kHz samples classified by the VAD so far (audio_start_ms / audio_end_ms)
        self.item_id: str | None = None  # item id of the user turn being spoken

    @property
    def position_ms(self) -> int:
        """How much input audio the VAD has classified (the offset audio_start_ms / audio_end_ms count from)."""
        return self._vad_pos * 1000 // ENGINE_IN_RATE

    @property
    def available(self) -> bool:
        """Whether this server runs a VAD at all."""
        return self._vad_factory is not None

    def reset(self) -> None:
        self._vad_pending = np.zeros(0, np.float32)
        self._prefix.clear()
        self.prefix_samples = 0
        self.in_speech = False
        self._silence_run = 0
        if self._vad is not None:
            self._vad.reset()

    async def feed(self, pcm16k: np.ndarray) -> None:
        s = self.s
        td = s.config.turn_detection
        assert td is not None
        vad = await self.ensure_vad()
        win = vad.window
        buf = np.concatenate([self._vad_pending, pcm16k]) if len(self._vad_pending) else pcm16k
        n_full = len(buf) // win * win
        self._vad_pending = buf[n_full:].copy()
        if n_full == 0:
            return
        # Classified with every other session's pending windows, in one batched call off the event loop.
        probs = await vad.probs(buf[:n_full].reshape(-1, win))
        for k, start in enumerate(range(0, n_full, win)):
            chunk = buf[start:start + win]
            self._vad_pos += win
            speech = probs[k] >= td.threshold
            if not self.in_speech:
                self._prefix.append(chunk)
                self.prefix_samples += len(chunk)
                keep = td.prefix_padding_ms * ENGINE_IN_RATE // 1000 + win
                while self._prefix and self.prefix_samples - len(self._prefix[0]) >= keep:
                    self.prefix_samples -= len(self._prefix.popleft())
                if speech:
                    await self._speech_started()
            else:
                self._silence_run = 0 if speech else self._silence_run + len(chunk)
                await s.input_buffer.send(chunk)
                if self._silence_run * 1000 >= td.silence_duration_ms * ENGINE_IN_RATE:
                    await self._speech_stopped()
            if s.closed:
                return

    async def ensure_vad(self) -> Any:
        if self._vad is None:
            if self._vad_factory is None:
                raise ProtocolError(errors.SERVER_VAD_UNAVAILABLE, "server_vad is not available on this server")
            vad = await asyncio.to_thread(self._vad_factory)  # the first one imports torch
            await vad.ready()  # the shared model loads once per process (tens of ms), not on a turn
            if self._vad is None:
                self._vad = vad
        return self._vad

    async def flush_prefix(self) -> None:
        """The prefix ring's audio goes to the engine (the start of a turn)."""
        if self._prefix:
            pcm = np.concatenate(list(self._prefix))
            self._prefix.clear()
            self.prefix_samples = 0
            await self.s.input_buffer.send(pcm)

    async def _speech_started(self) -> None:
        s = self.s
        self.in_speech = True
        self._silence_run = 0
        td = s.config.turn_detection
        # The prefix ring holds up to prefix_padding_ms before the window that triggered, and that window:
        # the turn's audio (and audio_start_ms, as in the GA API) begins where the ring begins.
        start_ms = (self._vad_pos - self.prefix_samples) * 1000 // ENGINE_IN_RATE
        self.item_id = ev.new_id("item")
        s.emit(ev.event("input_audio_buffer.speech_started", audio_start_ms=start_ms, item_id=self.item_id))
        await s.responses.user_started_speaking(interrupt=td is not None and td.interrupt_response)
        await self.flush_prefix()

    async def _speech_stopped(self) -> None:
        s = self.s
        td = s.config.turn_detection
        assert td is not None
        await s.engine_inputs.flush_user_audio()  # the turn's last audio (the silence run that ends it)
        self.in_speech = False
        self._silence_run = 0
        # The end of the audio sent for the turn, trailing silence included (GA semantics).
        end_ms = self._vad_pos * 1000 // ENGINE_IN_RATE
        s.emit(ev.event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=self.item_id))
        await s.input_buffer.commit(auto_response=td.create_response)
