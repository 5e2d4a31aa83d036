"""The input audio buffer: the user's audio at any rate resampled to the engine's 16 kHz and sent on (directly, or
through the server VAD's turns: turn_detection.py), its size limit, commit and clear.

With `turn_detection: null` every append streams to the engine and the client commits; with `server_vad` only
speech streams and the VAD commits. Either way the engine holds a turn's audio as it arrives.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from engines.protocol import errors
from engines.protocol import messages as m
from server.audio.resample import AudioError, Resampler
from server.session import server_events as ev
from server.session.client_json import ProtocolError

if TYPE_CHECKING:
    from server.session.session import Session

ENGINE_IN_RATE = 16000
CLIENT_RATE = 24000


class InputBuffer:
    def __init__(self, session: Session) -> None:
        self.s = session
        # Samples at 16 kHz sent to the engine since the last commit/clear (the part not yet sent waits in
        # EngineInputs)
        self.samples_16k = 0
        self.samples_client = 0  # client-rate samples appended since the last commit (limit check)
        # Whether any of it came in `input_audio_buffer.append` events (else only from a track's live mic)
        self.appended = False
        self._resamplers: dict[int, Resampler] = {}

    async def add(self, pcm: np.ndarray, rate: int, client_samples: int) -> None:
        s = self.s
        if s.config.turn_detection is not None and not s.turns.in_speech:
            self.samples_client = 0  # server_vad between turns buffers nothing (a live mic idles here)
        limit = int(s.limits.max_input_buffer_seconds * CLIENT_RATE)
        if self.samples_client + client_samples > limit:
            raise ProtocolError(errors.INPUT_AUDIO_BUFFER_TOO_LARGE,
                                f"the uncommitted input audio would exceed {s.limits.max_input_buffer_seconds:g} s;"
                                " commit or clear it")
        try:
            pcm16k = self._resampler(rate).process(pcm)
        except AudioError as e:
            raise ProtocolError(errors.INVALID_AUDIO, str(e)) from None
        self.samples_client += client_samples
        if s.config.turn_detection is None:
            await self.send(pcm16k)
        else:
            await s.turns.feed(pcm16k)

    def _resampler(self, rate: int) -> Resampler:
        # One streaming resampler per input rate, so chunk seams carry no filter edge effects.
        r = self._resamplers.get(rate)
        if r is None:
            r = self._resamplers[rate] = Resampler(rate, ENGINE_IN_RATE)
        return r

    async def flush_resamplers(self) -> None:
        """Client commit without VAD: the filter's tail belongs to this turn."""
        for rate, r in list(self._resamplers.items()):
            tail = r.flush()
            del self._resamplers[rate]
            if self.s.config.turn_detection is None:
                await self.send(tail)

    async def send(self, pcm16k: np.ndarray) -> None:
        """Audio of the user's turn (16 kHz) for the engine."""
        if len(pcm16k) == 0:
            return
        self.samples_16k += len(pcm16k)
        await self.s.engine_inputs.user_audio(pcm16k)

    async def commit(self, auto_response: bool, tentative: bool = False) -> None:
        """`tentative`: the VAD's guess that the turn ended (turn_detection.py); the engine can take it back."""
        s = self.s
        item_id = s.turns.item_id or ev.new_id("item")
        s.turns.item_id = None
        s.turns.in_speech = False
        prev = s.items[-1] if s.items else None
        await s.engine_inputs.send(m.CommitUserAudio(session_id=s.id, item_id=item_id, tentative=tentative,
                                                     transcribe=s.config.transcription is not None))
        self.samples_16k = 0
        self.samples_client = 0
        self.appended = False
        s.responses.turn_committed_at = time.monotonic()
        s.emit(ev.event("input_audio_buffer.committed", previous_item_id=prev, item_id=item_id))
        s.add_item(item_id, "user", [{"type": "input_audio", "transcript": None}])
        if auto_response:
            await s.responses.turn_ended()

    async def clear(self) -> None:
        s = self.s
        self._resamplers.clear()
        sent = self.samples_16k - s.engine_inputs.drop_user_audio()
        if sent:
            await s.engine_inputs.send(m.ClearUserAudio(session_id=s.id))
        self.samples_16k = 0
        self.samples_client = 0
        self.appended = False
        s.turns.item_id = None
        await s.turns.reset()
        s.emit(ev.event("input_audio_buffer.cleared"))

    def uncommitted_samples(self) -> int:
        """What the input buffer holds for the next commit. Without VAD: what the client appended (client rate; a
        few samples may still sit in the resampler, which a commit flushes). With server_vad: the speech already
        sent to the engine (16 kHz; silence between turns only fills the prefix ring)."""
        return self.samples_client if self.s.config.turn_detection is None else self.samples_16k

    async def settle(self, before: str) -> None:
        """The engine holds a turn's audio as it arrives, so an answer or an audio item cannot go in before that
        turn is committed or cleared (the engine would fail the answer, or join the item to the open turn).

        Push to talk over a track (WebRTC): the live mic never pauses, and frames still in flight land between a
        client's `input_audio_buffer.clear` and what it sends next; so uncommitted audio that came only from the
        track is cleared here (`input_audio_buffer.cleared` says so) and the request goes ahead. Audio the client
        appended itself, or speech server_vad has not yet ended, is the client's mistake and is refused."""
        if self.s.turns.spec is not None:  # the client has not seen this turn end: to it the user still speaks
            raise ProtocolError(errors.INPUT_AUDIO_BUFFER_NOT_EMPTY,
                                "the input audio buffer holds speech not yet committed (server_vad commits it when the "
                                f"speech stops): wait, or send input_audio_buffer.clear before {before}")
        held = self.uncommitted_samples()
        if not held:
            return
        if self.s.config.turn_detection is None and not self.appended:
            await self.clear()
            return
        if self.s.config.turn_detection is None:
            raise ProtocolError(errors.INPUT_AUDIO_BUFFER_NOT_EMPTY,
                                f"the input audio buffer holds {held * 1000 // CLIENT_RATE} ms not yet committed: "
                                f"send input_audio_buffer.commit or input_audio_buffer.clear before {before}")
        raise ProtocolError(errors.INPUT_AUDIO_BUFFER_NOT_EMPTY,
                            "the input audio buffer holds speech not yet committed (server_vad commits it when the "
                            "speech stops): wait, or send input_audio_buffer.commit or input_audio_buffer.clear "
                            f"before {before}")
