"""Server VAD turns (`turn_detection: server_vad` or `semantic_vad`): which input audio is the user speaking, and when
a turn starts and ends.

Silence before speech is only kept as a short prefix ring (prefix_padding_ms); from speech start the audio streams
to the engine, which encodes and prefills it while the user talks; when the turn ends it is committed and
(create_response) an answer is requested.

When a turn ends: server_vad after silence_duration_ms of silence. semantic_vad asks the end-of-turn model
(server/turn_model.py) about the turn's audio once the VAD has heard PROBE_WINDOWS of silence, and again at growing
intervals while the pause lasts. A session has one question out at a time (one due meanwhile is asked when the answer
comes, about the audio then), and a question whose pause has ended is withdrawn before the model runs it: the model
costs 35-55 ms of a core a question (server/turn_model.py), and at every short pause of natural speech each session
would otherwise queue questions whose answers nobody waits for, faster than one core answers them (16 sessions of
natural speech on a 2-core machine, 2026-12-02: speech end -> commit p50 1.1 s with this, 2.1 s without). The turn
ends at the first answer of P(complete) >= the eagerness's bar, or after its longest wait (low 8 s, medium and auto
4 s, high 2 s). With the server's `server_vad_end_of_turn`, server_vad turns ask the model too and end at a confident
answer (P >= 0.5) before silence_duration_ms.

The silence that ends a turn is counted in 32 ms VAD windows from where the voice ended: the first window Silero
scores below the threshold, and before it the windows it still called speech whose level had already fallen well
below the turn's loudest (server/session/voice_end.py: Silero's probability stays above the threshold for a window or
two after the voice stops). A turn ends at the first window that completes the silence, which is rounded up to whole
windows (300 ms -> 320 ms), plus up to one client frame for the window to fill.

Barge-in: speech_started while an answer is active or still playing (interrupt_response) cancels it, drops queued
answer audio and truncates the engine history to the audio the user heard (responses.Responses.user_started_speaking).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.protocol import errors
from engines.protocol import messages as m
from server.session import server_events as ev
from server.session.client_json import ProtocolError
from server.session.input_buffer import ENGINE_IN_RATE
from server.session.voice_end import VoiceEnd

if TYPE_CHECKING:
    from server.session.client_events import TurnDetection
    from server.session.session import Session

PROBE_WINDOWS = 3  # VAD windows of silence (96 ms, ~160 ms after the voice) before the end-of-turn model is asked
SPECULATE_WINDOWS = 5  # speculative_server_vad: VAD windows of silence (160 ms) before an answer starts, held
TURN_AUDIO_SAMPLES = 8 * ENGINE_IN_RATE  # what the end-of-turn model hears: the turn's last 8 s


@dataclass(frozen=True)
class Eagerness:
    bar: float  # P(complete) at which the turn probably ended
    confirm_ms: int | None  # held: the answer starts then and is heard once this much silence confirms the turn;
    # None: released, the turn ends at once
    longest_ms: int  # silence after which the turn ends whatever the model says


EAGERNESS = {"low": Eagerness(0.8, 600, 8000), "medium": Eagerness(0.5, 300, 4000),
             "auto": Eagerness(0.5, 300, 4000), "high": Eagerness(0.3, None, 2000)}
SERVER_VAD_EARLY_P = 0.5  # server_vad_end_of_turn: P(complete) that ends a server_vad turn before its silence


@dataclass
class _Speculation:
    """A tentative end of turn whose answer runs unheard (the session's outbound held) until it is confirmed."""

    item_id: str | None  # the turn's item, again the open turn's if the answer is withdrawn
    items: int  # conversation items before the turn's
    samples_16k: int  # the input buffer's count before the commit
    last: Any  # the answer before this one (conversation.item.truncate's)
    response_id: str | None = None
    audio: list[np.ndarray] = field(default_factory=list)  # what the user said since: theirs if it is withdrawn


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
        self._silence_run = 0  # samples the VAD has called silence since the last speech window
        self._voice_end = VoiceEnd()  # the levels that tell where the voice ended before the VAD's silence
        self._quiet_before = 0  # samples of this pause's quiet before the VAD's silence (`_silence_heard`)
        self._vad_pos = 0  # 16 kHz samples classified by the VAD so far (audio_start_ms / audio_end_ms)
        self.item_id: str | None = None  # item id of the user turn being spoken
        self._turn_audio: deque[np.ndarray] = deque()  # the turn's last TURN_AUDIO_SAMPLES (end-of-turn model)
        self._turn_samples = 0
        self._pause = 0  # bumped whenever a pause ends (speech, turn end, reset): a late model answer is stale
        self._next_probe = PROBE_WINDOWS  # silence windows at which the model is asked next in this pause
        self._probing: asyncio.Task[None] | None = None  # the question out to the model
        self._probe_due = False  # a question came due while one was out: asked when its answer comes
        self._lock = asyncio.Lock()  # a model answer ends a turn between two feeds, never inside one
        self.probes = 0  # end-of-turn model calls made (metrics, tests)
        self.spec: _Speculation | None = None

    @property
    def position_ms(self) -> int:
        """How much input audio the VAD has classified (the offset audio_start_ms / audio_end_ms count from)."""
        return self._vad_pos * 1000 // ENGINE_IN_RATE

    @property
    def available(self) -> bool:
        """Whether this server runs a VAD at all."""
        return self._vad_factory is not None

    def held_response(self) -> str | None:
        """The id of the answer started on a tentative end of turn and not yet heard (None: none is held)."""
        return None if self.spec is None else self.spec.response_id

    async def reset(self) -> None:
        """New settings or a cleared buffer: the turn starts over. Between two feeds and after a model answer's turn
        end, never inside one (an answer starting on a guess holds the client's events until its turn is settled)."""
        async with self._lock:
            self._reset()

    def _reset(self) -> None:
        self._end_pause()
        if self.spec is not None:  # new settings or a cleared buffer: the answer under way stands
            self.spec = None
            self.s.tasks.spawn(self.s.engine.send(m.ConfirmUserAudio(session_id=self.s.id)), "confirm")
            if not self.s.outbound.release():
                self.s.slow_consumer()
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
                    await self._speech_started(chunk)
            else:
                if speech and self._silence_run:
                    self._end_pause()
                    self._next_probe = PROBE_WINDOWS
                    self._voice_end.resumed()
                if speech:
                    self._voice_end.speech(chunk)
                elif not self._silence_run:
                    self._quiet_before = self._voice_end.quiet_windows() * win
                self._silence_run = 0 if speech else self._silence_run + len(chunk)
                self._keep_turn_audio(chunk)
                if self.spec is not None:
                    self.spec.audio.append(chunk)
                    if speech:
                        await self._withdraw()
                    elif self._silence_heard() * 1000 >= self._confirm_ms(td) * ENGINE_IN_RATE:
                        await self._confirm()
                    continue
                await s.input_buffer.send(chunk)
                if self._silence_heard() * 1000 >= self._longest_silence_ms(td) * ENGINE_IN_RATE:
                    await self._speech_stopped()
                elif (self._silence_run == SPECULATE_WINDOWS * win and td.type == "server_vad"
                      and getattr(vad, "speculative_server_vad", False)
                      and td.silence_duration_ms > SPECULATE_WINDOWS * win * 1000 // ENGINE_IN_RATE):
                    await self._speculate()
                elif self._silence_run >= self._next_probe * win and self._asks_model(td):
                    self._next_probe = 2 * self._next_probe + PROBE_WINDOWS  # 3, 9, 21, 45... windows
                    self._ask_model()
            if s.closed:
                return

    def _silence_heard(self) -> int:
        """Samples of this pause's silence: the VAD's, and the quiet just before it (what ends a turn or confirms a
        held answer; the end-of-turn model's questions and a speculative answer's start count the VAD's alone, as
        sentence pauses of 200 ms would otherwise set them off)."""
        return self._silence_run + self._quiet_before if self._silence_run else 0

    @staticmethod
    def _longest_silence_ms(td: TurnDetection) -> int:
        return EAGERNESS[td.eagerness].longest_ms if td.type == "semantic_vad" else td.silence_duration_ms

    @staticmethod
    def _confirm_ms(td: TurnDetection) -> int:
        return (EAGERNESS[td.eagerness].confirm_ms or 0) if td.type == "semantic_vad" else td.silence_duration_ms

    def _asks_model(self, td: TurnDetection) -> bool:
        vad = self._vad
        return getattr(vad, "end_of_turn", None) is not None and (
            td.type == "semantic_vad" or vad.end_of_turn_in_server_vad)

    def _end_pause(self) -> None:
        """The pause (if any) is over: an answer about it is stale, and a question still queued is withdrawn."""
        self._pause += 1
        self._probe_due = False
        t = self._probing
        if t is not None and not t.done() and t is not asyncio.current_task():
            t.cancel()  # a question the model has not started is skipped; one it runs is ignored on return

    def _ask_model(self) -> None:
        if self._probing is not None and not self._probing.done():
            self._probe_due = True
            return
        self._probe_due = False
        self.probes += 1
        self._probing = self.s.tasks.spawn(self._probe(self._pause, np.concatenate(list(self._turn_audio))),
                                           "end-of-turn")

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
            if td.type == "server_vad":
                if p >= SERVER_VAD_EARLY_P:
                    await (self._confirm() if self.spec is not None else self._speech_stopped())
            elif self.spec is None and p >= EAGERNESS[td.eagerness].bar:
                await (self._speech_stopped() if EAGERNESS[td.eagerness].confirm_ms is None else self._speculate())
            if self._probe_due and pause == self._pause and self.in_speech and self.spec is None:
                self._probing = None  # (this task, ending)
                self._ask_model()

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

    async def _speech_started(self, first: np.ndarray) -> None:
        s = self.s
        self.in_speech = True
        self._silence_run = 0
        self._voice_end.start(first)
        td = s.config.turn_detection
        # The prefix ring holds up to prefix_padding_ms before the window that triggered, and that window:
        # the turn's audio (and audio_start_ms, as in the GA API) begins where the ring begins.
        start_ms = (self._vad_pos - self.prefix_samples) * 1000 // ENGINE_IN_RATE
        self._turn_audio, self._turn_samples = deque(self._prefix), self.prefix_samples
        self._end_pause()
        self._next_probe = PROBE_WINDOWS
        self.item_id = ev.new_id("item")
        s.emit(ev.event("input_audio_buffer.speech_started", audio_start_ms=start_ms, item_id=self.item_id))
        await s.responses.user_started_speaking(interrupt=td is not None and td.interrupt_response)
        await self.flush_prefix()

    def _can_speculate(self) -> bool:
        """An answer can start on a guess only if it would be the engine's next input and nothing else is due."""
        s = self.s
        td = s.config.turn_detection
        return (td is not None and td.create_response and s.responses.active is None and not s.outbound.holding
                and s.engine_inputs.idle)

    async def _speculate(self) -> None:
        """The turn probably ended: commit it tentatively and start its answer, everything the client would see
        held (turn end included) until the silence confirms it (_confirm) or the user goes on (_withdraw). When
        an answer cannot start yet (one is still ending), the turn waits for its silence as it would anyway."""
        if not self._can_speculate():
            return
        s = self.s
        spec = _Speculation(self.item_id, len(s.items), s.input_buffer.samples_16k, s.responses.last)
        s.outbound.hold()
        listening = self._silence_run, self._turn_audio, self._turn_samples
        await self._speech_stopped(tentative=True)
        # The VAD still listens to this turn: its silence goes on counting, its audio is the model's if it goes on.
        self.in_speech = True
        self._silence_run, self._turn_audio, self._turn_samples = listening
        spec.response_id = None if s.responses.active is None else s.responses.active.id
        self.spec = spec

    async def _confirm(self) -> None:
        s, spec = self.s, self.spec
        assert spec is not None
        self.spec = None
        # The client sees the turn end now: its answer's time to first audio counts from here, as without speculation
        r = s.responses.active or s.responses.last
        if r is not None and r.id == spec.response_id:
            r.playback.turn_start = time.monotonic()
        self._observe_turn_end()
        self.in_speech = False
        self._silence_run = 0
        self._end_pause()
        self._turn_audio.clear()
        self._turn_samples = 0
        await s.engine.send(m.ConfirmUserAudio(session_id=s.id))
        if s.observer is not None:
            s.observer.speculation(withdrawn=False)
        if not s.outbound.release():
            s.slow_consumer()

    async def _withdraw(self) -> None:
        """The user went on: the answer goes unseen, the engine rolls it back, the turn continues with what the
        user said meanwhile. Items the client created meanwhile stay, in order, and are shown again (their events
        were held with the answer's)."""
        s, spec = self.s, self.spec
        assert spec is not None
        self.spec = None
        if not s.outbound.discard():
            s.slow_consumer()
        answer_item = None
        if spec.response_id is not None:
            r = s.responses.active if s.responses.active is not None else s.responses.last
            answer_item = r.item_id if r is not None and r.id == spec.response_id else None
            await s.responses.withdraw(spec.response_id, spec.last)
        created = [i for i in s.items[spec.items + 1:] if i != answer_item]  # after the turn's own item
        del s.items[spec.items:]
        if answer_item is not None:
            s.item_objs.pop(answer_item, None)
            s.item_audio_samples.pop(answer_item, None)
        for item_id in created:
            s.append_item(item_id)
        s.input_buffer.samples_16k = spec.samples_16k
        s.responses.turn_committed_at = None
        self.item_id = spec.item_id
        self._end_pause()
        self._next_probe = PROBE_WINDOWS
        for pcm in spec.audio:
            await s.input_buffer.send(pcm)

    def _observe_turn_end(self) -> None:
        """The silence heard when the client is told the turn ended: the detector's own wait, in audio time (the
        VAD's lag and the transport's not counted)."""
        if self.s.observer is not None:
            self.s.observer.turn_end(self._silence_heard() / ENGINE_IN_RATE)

    async def _speech_stopped(self, tentative: bool = False) -> None:
        s = self.s
        td = s.config.turn_detection
        assert td is not None
        await s.engine_inputs.flush_user_audio()  # the turn's last audio (the silence run that ends it)
        if not tentative:
            self._observe_turn_end()
        self.in_speech = False
        self._silence_run = 0
        self._end_pause()
        self._turn_audio = deque()
        self._turn_samples = 0
        # The end of the audio sent for the turn, trailing silence included (GA semantics).
        end_ms = self._vad_pos * 1000 // ENGINE_IN_RATE
        s.emit(ev.event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=self.item_id))
        await s.input_buffer.commit(auto_response=td.create_response, tentative=tentative)
