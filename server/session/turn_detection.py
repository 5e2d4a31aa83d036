"""Server VAD turns (`turn_detection: server_vad` or `semantic_vad`): which input audio is the user speaking, and when
a turn starts and ends.

Silence before speech is only kept as a short prefix ring (prefix_padding_ms); from speech start the audio streams
to the engine, which encodes and prefills it while the user talks; when the turn ends it is committed and
(create_response) an answer is requested.

When a turn ends: server_vad after silence_duration_ms of silence. semantic_vad asks the end-of-turn model
(server/turn_model.py) about the turn's audio once the VAD has heard PROBE_WINDOWS of silence, and again at growing
intervals while the pause lasts; the turn ends at the first answer of P(complete) >= the eagerness's bar, or after
its longest wait (low 8 s, medium and auto 4 s, high 2 s). With the server's `server_vad_end_of_turn`, server_vad
turns ask the model too and end at a confident answer (P >= 0.5) before silence_duration_ms.

Silence is counted from the first 32 ms window Silero scores below the threshold, and a turn ends at the first
window that completes the silence: Silero's probability stays above 0.5 for one or two windows after the voice stops
(~60 ms on the repository's sample), and the silence is rounded up to whole windows (300 ms -> 320 ms), so a turn
ends ~80 ms after `silence_duration_ms` of real silence, plus up to one client frame for the window to fill.

Barge-in: speech_started while an answer is active (interrupt_response) cancels it, drops queued answer audio and
truncates the engine history to the audio the user heard (pacing.Playback.played).
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
    from server.session.client_events import TurnDetection
    from server.session.session import Session

PROBE_WINDOWS = 3  # VAD windows of silence (96 ms, ~160 ms after the voice) before the end-of-turn model is asked
TURN_AUDIO_SAMPLES = 8 * ENGINE_IN_RATE  # what the end-of-turn model hears: the turn's last 8 s
# semantic_vad: (P(complete) that ends the turn at once, the longest silence before it ends anyway, ms)
EAGERNESS = {"low": (0.8, 8000), "medium": (0.5, 4000), "high": (0.3, 2000), "auto": (0.5, 4000)}
SERVER_VAD_EARLY_P = 0.5  # server_vad_end_of_turn: P(complete) that ends a server_vad turn before its silence


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
        self._turn_audio: deque[np.ndarray] = deque()  # the turn's last TURN_AUDIO_SAMPLES (end-of-turn model)
        self._turn_samples = 0
        self._pause = 0  # bumped whenever a pause ends (speech, turn end, reset): a late model answer is stale
        self._next_probe = PROBE_WINDOWS  # silence windows at which the model is asked next in this pause
        self._lock = asyncio.Lock()  # a model answer ends a turn between two feeds, never inside one
        self.probes = 0  # end-of-turn model calls made (metrics, tests)

    @property
    def available(self) -> bool:
        """Whether this server runs a VAD at all."""
        return self._vad_factory is not None

    def reset(self) -> None:
        self._pause += 1
        self._turn_audio.clear()
        self._turn_samples = 0
        self._vad_pending = np.zeros(0, np.float32)
        self._prefix.clear()
        self.prefix_samples = 0
        self.in_speech = False
        self._silence_run = 0
        if self._vad is not None:
            self._vad.reset()

    async def feed(self, pcm16k: np.ndarray) -> None:
        async with self._lock:
            await self._feed(pcm16k)

    async def _feed(self, pcm16k: np.ndarray) -> None:
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
                if speech and self._silence_run:
                    self._pause += 1
                    self._next_probe = PROBE_WINDOWS
                self._silence_run = 0 if speech else self._silence_run + len(chunk)
                self._keep_turn_audio(chunk)
                await s.input_buffer.send(chunk)
                if self._silence_run * 1000 >= self._longest_silence_ms(td) * ENGINE_IN_RATE:
                    await self._speech_stopped()
                elif self._silence_run >= self._next_probe * win and self._asks_model(td):
                    self._next_probe = 2 * self._next_probe + PROBE_WINDOWS  # 3, 9, 21, 45... windows
                    self.probes += 1
                    s.tasks.spawn(self._probe(self._pause, np.concatenate(list(self._turn_audio))), "end-of-turn")
            if s.closed:
                return

    @staticmethod
    def _longest_silence_ms(td: TurnDetection) -> int:
        return EAGERNESS[td.eagerness][1] if td.type == "semantic_vad" else td.silence_duration_ms

    def _asks_model(self, td: TurnDetection) -> bool:
        vad = self._vad
        return getattr(vad, "end_of_turn", None) is not None and (
            td.type == "semantic_vad" or vad.end_of_turn_in_server_vad)

    def _keep_turn_audio(self, chunk: np.ndarray) -> None:
        self._turn_audio.append(chunk)
        self._turn_samples += len(chunk)
        while self._turn_samples - len(self._turn_audio[0]) >= TURN_AUDIO_SAMPLES:
            self._turn_samples -= len(self._turn_audio.popleft())

    async def _probe(self, pause: int, audio: np.ndarray) -> None:
        """The end-of-turn model's answer for this pause: the turn ends if it is confident enough and the pause
        still lasts (no speech, no turn end or reset since it was asked)."""
        try:
            p = await self._vad.end_of_turn.complete(audio)
        except Exception:  # noqa: BLE001 - the turn still ends after its longest silence
            self.s.log.exception("end-of-turn model failed")
            return
        async with self._lock:
            td = self.s.config.turn_detection
            if self.s.closed or td is None or pause != self._pause or not self.in_speech:
                return
            bar = EAGERNESS[td.eagerness][0] if td.type == "semantic_vad" else SERVER_VAD_EARLY_P
            if p >= bar:
                await self._speech_stopped()

    async def ensure_vad(self) -> Any:
        if self._vad is None:
            if self._vad_factory is None:
                raise ProtocolError(errors.SERVER_VAD_UNAVAILABLE, "server_vad is not available on this server")
            vad = await asyncio.to_thread(self._vad_factory)  # the first one imports torch
            await vad.ready()  # the shared model loads once per process (tens of ms), not on a turn
            if self._vad is None:
                self._vad = vad
        return self._vad

    async def check(self, td: TurnDetection | None) -> None:
        """Refuses settings this server cannot serve (session.update), before they apply."""
        if td is None:
            return
        if not self.available:
            raise ProtocolError(errors.SERVER_VAD_UNAVAILABLE, "server_vad is disabled on this server; use "
                                "turn_detection null and input_audio_buffer.commit",
                                "session.audio.input.turn_detection")
        if td.type == "semantic_vad":
            vad = await self.ensure_vad()
            if getattr(vad, "end_of_turn", None) is None:
                raise ProtocolError(errors.SEMANTIC_VAD_UNAVAILABLE, "semantic_vad is not available on this server "
                                    "(it runs without its end-of-turn model); use server_vad",
                                    "session.audio.input.turn_detection.type")
            await vad.end_of_turn.ready()

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
        r = s.responses.active
        if r is not None and td is not None and td.interrupt_response:
            await s.responses.cancel("turn_detected", r.playback.played())
        # The prefix ring holds up to prefix_padding_ms before the window that triggered, and that window:
        # the turn's audio (and audio_start_ms, as in the GA API) begins where the ring begins.
        start_ms = (self._vad_pos - self.prefix_samples) * 1000 // ENGINE_IN_RATE
        self._turn_audio, self._turn_samples = deque(self._prefix), self.prefix_samples
        self._pause += 1
        self._next_probe = PROBE_WINDOWS
        await self.flush_prefix()
        self.item_id = ev.new_id("item")
        s.emit(ev.event("input_audio_buffer.speech_started", audio_start_ms=start_ms, item_id=self.item_id))

    async def _speech_stopped(self) -> None:
        s = self.s
        td = s.config.turn_detection
        assert td is not None
        await s.engine_inputs.flush_user_audio()  # the turn's last audio (the silence run that ends it)
        self.in_speech = False
        self._silence_run = 0
        self._pause += 1
        self._turn_audio.clear()
        self._turn_samples = 0
        # The end of the audio sent for the turn, trailing silence included (GA semantics).
        end_ms = self._vad_pos * 1000 // ENGINE_IN_RATE
        s.emit(ev.event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=self.item_id))
        await s.input_buffer.commit(auto_response=td.create_response)
