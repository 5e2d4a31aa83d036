"""Audio between aiortc tracks and a session: the paced outbound answer track and the inbound mic pump.

Outbound: the session hands 24 kHz int16 PCM; we resample to 48 kHz (Opus's clock) and hand aiortc one
20 ms frame per `recv()`, paced at real time. A small jitter buffer primes each answer (and re-primes after
an underrun) so network-sized gaps between codec chunks do not turn into clicks; when there is no answer
the track sends silence, so the browser's jitter buffer and the RTP clock never stall.

Inbound: aiortc decodes the user's Opus to 48 kHz s16 frames; we downmix to mono and resample to 16 kHz,
the rate VAD and the speech encoder take.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from server.audio.pcm import float32_to_pcm16, pcm16_to_float32
from server.audio.resample import Resampler

log = logging.getLogger(__name__)

OPUS_RATE = 48_000
ANSWER_RATE = 24_000
INPUT_RATE = 16_000
FRAME_SAMPLES = 960  # 20 ms at 48 kHz
_FRAME_S = FRAME_SAMPLES / OPUS_RATE
_MAX_LAG_S = 0.2  # after an event-loop stall longer than this we re-anchor the clock instead of bursting
_SILENCE = bytes(FRAME_SAMPLES * 2)


@dataclass
class OutboundStats:
    frames_sent: int = 0
    audio_frames_sent: int = 0  # frames that carried answer audio (not idle silence)
    underruns: int = 0  # answer audio ran dry before the answer ended
    clock_resets: int = 0


class OutboundAudioTrack(MediaStreamTrack):
    """The answer as an Opus-bound track: push 24 kHz PCM per response, get paced 48 kHz mono frames out.

    Callbacks (all on the event loop): `on_started(response_id)` when the first frame of an answer leaves
    (the server's end of TTFA), `on_played(response_id, samples_24k)` after every frame of answer audio (the
    cumulative count the session truncates at on barge-in), `on_stopped(response_id)` when a finished answer
    has been played out.
    """

    kind = "audio"

    def __init__(
        self,
        *,
        prebuffer_ms: int = 60,
        on_started: Callable[[str], None] | None = None,
        on_stopped: Callable[[str], None] | None = None,
        on_played: Callable[[str, int], None] | None = None,
    ) -> None:
        super().__init__()
        if prebuffer_ms < 0 or prebuffer_ms > 2000:
            raise ValueError(f"prebuffer_ms must be in [0, 2000], got {prebuffer_ms}")
        self._prebuffer = prebuffer_ms * OPUS_RATE // 1000
        self._on_started = on_started
        self._on_stopped = on_stopped
        self._on_played = on_played
        self._buf = bytearray()  # pending 48 kHz int16 mono of the current answer
        self._resampler = Resampler(ANSWER_RATE, OPUS_RATE)
        self._response_id: str | None = None
        self._input_done = False  # the session sent the whole answer; play out what is left
        self._primed = False
        self._started = False
        self._played48 = 0  # samples of the current answer that left in frames
        self._pts = 0
        self._t0: float | None = None
        self.stats = OutboundStats()

    # ---- producer side (session) ----------------------------------------------------------

    @property
    def response_id(self) -> str | None:
        return self._response_id

    @property
    def played_samples_24k(self) -> int:
        """Samples of the current answer, in 24 kHz units, that have been sent (for truncation on barge-in)."""
        return self._played48 * ANSWER_RATE // OPUS_RATE

    @property
    def buffered_ms(self) -> float:
        return len(self._buf) / 2 / OPUS_RATE * 1000

    def push(self, response_id: str, pcm24k: bytes) -> None:
        if response_id != self._response_id:
            self._begin(response_id)
        self._buf += float32_to_pcm16(self._resampler.process(pcm16_to_float32(pcm24k)))  # 24 -> 48 kHz

    def end_response(self, response_id: str) -> None:
        """No more audio will come for this answer: drain the resampler and let the tail play unprimed."""
        if response_id != self._response_id or self._input_done:
            return
        self._buf += float32_to_pcm16(self._resampler.flush())
        self._input_done = True

    def clear(self) -> tuple[str | None, int]:
        """Drop queued answer audio (barge-in, cancel). Returns (response id, 24 kHz samples already sent)."""
        rid, played = self._response_id, self.played_samples_24k
        self._buf.clear()
        self._resampler = Resampler(ANSWER_RATE, OPUS_RATE)
        self._response_id = None
        self._input_done = False
        self._primed = self._started = False
        self._played48 = 0
        return rid, played

    def _begin(self, response_id: str) -> None:
        self.clear()
        self._response_id = response_id

    # ---- consumer side (aiortc's RTP sender) --------------------------------------------

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        await self._pace()
        frame = AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(self.pull())
        frame.pts = self._pts
        frame.sample_rate = OPUS_RATE
        frame.time_base = fractions.Fraction(1, OPUS_RATE)
        self._pts += FRAME_SAMPLES
        self.stats.frames_sent += 1
        return frame

    async def _pace(self) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
            return
        due = self._t0 + self.stats.frames_sent * _FRAME_S
        if now - due > _MAX_LAG_S:
            self._t0 = now - self.stats.frames_sent * _FRAME_S
            self.stats.clock_resets += 1
        elif due > now:
            await asyncio.sleep(due - now)

    def pull(self) -> bytes:
        """The next 20 ms of 48 kHz int16 mono (answer audio or silence), without pacing."""
        need = FRAME_SAMPLES * 2
        if self._response_id is None:
            return _SILENCE
        if not self._primed:
            if len(self._buf) >= max(self._prebuffer * 2, need) or (self._input_done and self._buf):
                self._primed = True
            elif self._input_done:
                return self._finish()
            else:
                return _SILENCE
        if len(self._buf) < need and not self._input_done:
            # Ran dry mid-answer: send silence and re-prime rather than chopping the next chunk into the gap.
            self.stats.underruns += 1
            self._primed = False
            return _SILENCE
        payload = bytes(self._buf[:need])
        del self._buf[:need]
        self._played48 += len(payload) // 2
        self.stats.audio_frames_sent += 1
        if not self._started:
            self._started = True
            self._notify(self._on_started, self._response_id)
        if self._on_played is not None:
            try:
                self._on_played(self._response_id, self.played_samples_24k)
            except Exception:
                log.exception("outbound audio listener failed")
        if self._input_done and not self._buf:
            self._finish()
        return payload.ljust(need, b"\0")

    def _finish(self) -> bytes:
        rid = self._response_id
        self._response_id = None
        self._input_done = False
        self._primed = False
        if self._started:
            self._notify(self._on_stopped, rid)
        self._started = False
        return _SILENCE

    @staticmethod
    def _notify(cb: Callable[[str], None] | None, rid: str | None) -> None:
        if cb is not None and rid is not None:
            try:
                cb(rid)
            except Exception:  # a broken listener must not stop the audio clock
                log.exception("outbound audio listener failed")


def frame_to_mono(frame: AudioFrame) -> np.ndarray:
    """Any s16/flt aiortc frame -> mono float32 in [-1, 1] at the frame's own rate."""
    data = frame.to_ndarray()  # packed: [1, n * channels]; planar: [channels, n]
    channels = len(frame.layout.channels)
    x = data.reshape(channels, -1) if frame.format.is_planar else data.reshape(-1, channels).T  # [channels, n]
    x = x.astype(np.float32)
    if frame.format.name.startswith("s16"):
        x /= 32768.0
    elif frame.format.name.startswith("s32"):
        x /= 2147483648.0
    return x.mean(axis=0)  # [n]


async def pump_inbound(track: MediaStreamTrack, sink: Callable[[np.ndarray, int], Awaitable[None]]) -> int:
    """Read the user's track until it ends; hand 16 kHz float32 mono to `sink(pcm, 16000)`. Returns frames read.

    One streaming resampler per stream: resampling each 20 ms frame on its own would click at every seam.
    """
    resampler: Resampler | None = None
    rate = None
    frames = 0
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return frames
        frames += 1
        if frame.sample_rate != rate:
            rate = frame.sample_rate
            resampler = Resampler(rate, INPUT_RATE)
        pcm = resampler.process(frame_to_mono(frame))
        if len(pcm):
            await sink(pcm, INPUT_RATE)
