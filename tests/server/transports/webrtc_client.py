"""A WebRTC client for the transport tests: an aiortc peer that behaves like the web page (mic track from a WAV,
`oai-events` data channel, answer track recorder), and helpers around it."""

from __future__ import annotations

import asyncio
import fractions
import json
import time

import httpx
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from server.audio.pcm import float32_to_pcm16, read_wav
from server.transports.webrtc.tracks import FRAME_SAMPLES, OPUS_RATE, frame_to_mono

SILENT_RMS = 0.003  # same threshold as the page (client_web/app.js LEVEL_THRESHOLD)


class WavMicTrack(MediaStreamTrack):
    """A fake microphone: the WAV at real time in 20 ms frames (48 kHz), then silence."""

    kind = "audio"

    def __init__(self, path, lead_silence_s: float = 0.5, again_after_s: float | None = None) -> None:
        """`again_after_s`: say it a second time, after that much silence."""
        super().__init__()
        x, _ = read_wav(path, target_rate=OPUS_RATE)
        parts = [np.zeros(int(lead_silence_s * OPUS_RATE), np.float32), x]
        if again_after_s is not None:
            parts += [np.zeros(int(again_after_s * OPUS_RATE), np.float32), x]
        self._pcm = np.concatenate(parts)
        self._pos = 0
        self._t0: float | None = None
        self.finished_at: float | None = None

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._t0 is None:
            self._t0 = time.monotonic()
        due = self._t0 + self._pos / OPUS_RATE
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        piece = self._pcm[self._pos:self._pos + FRAME_SAMPLES]
        if len(piece) < FRAME_SAMPLES and self.finished_at is None:
            self.finished_at = time.monotonic()
        frame = AudioFrame(format="s16", layout="mono", samples=FRAME_SAMPLES)
        frame.planes[0].update(float32_to_pcm16(np.pad(piece, (0, FRAME_SAMPLES - len(piece)))))
        frame.pts = self._pos
        frame.sample_rate = OPUS_RATE
        frame.time_base = fractions.Fraction(1, OPUS_RATE)
        self._pos += FRAME_SAMPLES
        return frame


class Client:
    """An aiortc peer that behaves like the web page: mic track, `oai-events` channel, answer track recorder."""

    def __init__(self, base_url: str, mic: MediaStreamTrack | None) -> None:
        self.base_url = base_url
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.events: list[tuple[float, dict]] = []
        self.frames: list[tuple[float, np.ndarray]] = []  # (arrival time, mono float32 at 48 kHz)
        self.call_id: str | None = None
        self._event_seen = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        if mic is not None:
            self.pc.addTrack(mic)
        else:
            self.pc.addTransceiver("audio", direction="recvonly")
        self.channel = self.pc.createDataChannel("oai-events")
        self.channel.on("message", self._on_message)
        self.pc.on("track", lambda track: self._tasks.append(asyncio.ensure_future(self._record(track))))

    def _on_message(self, msg: str) -> None:
        self.events.append((time.monotonic(), json.loads(msg)))
        self._event_seen.set()

    async def _record(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            self.frames.append((time.monotonic(), frame_to_mono(frame)))

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(self, http: httpx.AsyncClient) -> None:
        r = await http.post(f"{self.base_url}/v1/realtime/calls", content=await self.offer(),
                            headers={"Content-Type": "application/sdp"})
        assert r.status_code == 201, r.text
        assert r.headers["content-type"].startswith("application/sdp")
        loc = r.headers["location"]
        assert loc.startswith("/v1/realtime/calls/rtc_")
        self.call_id = loc.rsplit("/", 1)[1]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))

    def types(self) -> list[str]:
        return [e["type"] for _, e in self.events]

    async def wait_event(self, etype: str, timeout: float) -> tuple[float, dict]:
        deadline = time.monotonic() + timeout
        while True:
            for t, e in self.events:
                if e["type"] == etype:
                    return t, e
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {etype} within {timeout} s; got {self.types()}")
            self._event_seen.clear()
            try:
                await asyncio.wait_for(self._event_seen.wait(), left)
            except TimeoutError:
                pass

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    async def frames_through(self, call, timeout: float = 60.0) -> None:
        """Until the frames the server's answer track has sent so far have reached this client: those in flight when
        an event on the data channel overtook them included. (Silence keeps coming after the answer, so frames the
        client never had, before its receiver was ready, only make this wait a few frames longer.)"""
        n = call.track.stats.frames_sent
        await wait_until(lambda: len(self.frames) >= n, timeout, f"{n} frames of the answer track")

    def loud(self, frames: list[tuple[float, np.ndarray]] | None = None) -> list[bool]:
        return [np.sqrt(np.mean(x ** 2)) > SILENT_RMS for _, x in (self.frames if frames is None else frames)]

    def first_audible_after(self, t0: float) -> float | None:
        for t, x in self.frames:
            if t >= t0 and np.sqrt(np.mean(x ** 2)) > SILENT_RMS:
                return t
        return None

    def audio_after(self, t0: float) -> np.ndarray:
        return np.concatenate([x for t, x in self.frames if t >= t0] or [np.zeros(0, np.float32)])

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.pc.close()


async def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def dominant_hz(x: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * rate / len(x))


async def offer_sdp() -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10)
