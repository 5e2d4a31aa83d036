"""The WebRTC transport (aiortc): POST /v1/realtime/calls with an SDP offer, the microphone as an Opus track,
events on the `oai-events` data channel, the answer heard on the server's audio track.

What the client can measure over WebRTC: TTFA is the first answer frame louder than -50 dBFS (the web page's
rule) after speech end / commit; the answer lasts from then to the server's `output_audio_buffer.stopped`.
Frames arrive on the sender's clock, so the playback buffer sees transport jitter and loss; holes the server
itself fills with silence are not visible as gaps here (the server's /metrics counts those).
"""

from __future__ import annotations

import asyncio
import base64
import fractions
import json
from typing import Any

import httpx
import numpy as np
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.results import CONNECT_FAILED
from moss_speech.loadtest.stats import SAMPLE_RATE
from moss_speech.loadtest.user import SessionFailed, SimulatedUser

EVENT_CHANNEL = "oai-events"
AUDIBLE = 32768 * 10 ** (-50 / 20)  # -50 dBFS, as the web page's TTFA rule
COMMIT_DELAY_S = 0.15  # commit mode: let the last RTP frames reach the server before the commit (data channel)
NO_AUDIO_GRACE_S = 1.0  # response.done without output_audio_buffer.started: wait this long for audio


def unavailable_reason(cfg: LoadConfig) -> str | None:
    """None when the server answers the WebRTC endpoints; else why the webrtc transport cannot run."""
    try:
        r = httpx.post(cfg.http_url("/v1/realtime/calls"), content=b"", timeout=10,
                       headers={**cfg.auth_headers, "Content-Type": "application/sdp"})
    except httpx.HTTPError as e:
        return f"cannot reach {cfg.http_url('/v1/realtime/calls')}: {e}"
    if r.status_code in (404, 405):
        return (f"the server has no WebRTC endpoint (POST /v1/realtime/calls answered {r.status_code}); "
                "use --transport ws")
    return None


_ice_cache: dict[str, list[RTCIceServer]] = {}


async def server_ice_servers(cfg: LoadConfig) -> list[RTCIceServer]:
    """The STUN/TURN servers the server hands to browsers (GET /v1/info), so a remote test can cross NAT the
    same way; none (host candidates only, e.g. loopback) when it lists none. Fetched once per process."""
    url = cfg.http_url("/v1/info")
    if url not in _ice_cache:
        servers: list[RTCIceServer] = []
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.get(url, headers=cfg.auth_headers)
            for s in (r.json().get("ice_servers") or []) if r.status_code == 200 else []:
                servers.append(RTCIceServer(urls=s["urls"], username=s.get("username"),
                                            credential=s.get("credential")))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            servers = []
        _ice_cache[url] = servers
    return _ice_cache[url]


class _MicTrack(MediaStreamTrack):
    """The user's microphone: 24 kHz mono PCM16 frames on an absolute real-time schedule (aiortc encodes Opus)."""

    kind = "audio"

    def __init__(self, user: WebRtcUser) -> None:
        super().__init__()
        self.user = user
        self.samples = SAMPLE_RATE * user.cfg.frame_ms // 1000
        self._t0: float | None = None
        self._n = 0

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = self.user.loop
        if self._t0 is None:
            self._t0 = loop.time()
        self._n += 1
        delay = self._t0 + self._n * self.samples / SAMPLE_RATE - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            self.user.max_lag_s = max(self.user.max_lag_s, -delay)
        frame = AudioFrame(format="s16", layout="mono", samples=self.samples)
        frame.planes[0].update(self.user.next_mic_frame())
        frame.pts = (self._n - 1) * self.samples
        frame.sample_rate = SAMPLE_RATE
        frame.time_base = fractions.Fraction(1, SAMPLE_RATE)
        return frame


class WebRtcUser(SimulatedUser):
    mic_is_track = True
    pc: RTCPeerConnection | None = None
    channel: Any = None
    call_url: str | None = None
    _tasks: list[asyncio.Task]

    @staticmethod
    def prepare_frames(frames_b64: list[str], silence_b64: str) -> tuple[list[bytes], bytes]:
        return [base64.b64decode(f) for f in frames_b64], base64.b64decode(silence_b64)

    async def open(self) -> None:
        self._tasks = []
        # An explicit list even when empty: aiortc would otherwise add a public STUN server.
        self.pc = pc = RTCPeerConnection(RTCConfiguration(iceServers=await server_ice_servers(self.cfg)))
        pc.addTrack(_MicTrack(self))
        self.channel = ch = pc.createDataChannel(EVENT_CHANNEL)
        opened = self.loop.create_future()

        @ch.on("open")
        def _open() -> None:
            if not opened.done():
                opened.set_result(None)

        @ch.on("message")
        def _message(msg: str | bytes) -> None:
            self.on_message(msg, self.loop.time())

        @ch.on("close")
        def _closed() -> None:
            self.on_closed("the oai-events data channel closed")

        @pc.on("track")
        def _track(track: MediaStreamTrack) -> None:
            if track.kind == "audio":
                self._tasks.append(asyncio.ensure_future(self._listen(track)))

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed"):
                self.on_closed(f"peer connection {pc.connectionState}")

        await pc.setLocalDescription(await pc.createOffer())
        async with httpx.AsyncClient(timeout=15) as http:
            r = await http.post(self.cfg.http_url("/v1/realtime/calls"), content=pc.localDescription.sdp.encode(),
                                headers={**self.cfg.auth_headers, "Content-Type": "application/sdp"})
        if r.status_code != 201:
            try:
                code = r.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = CONNECT_FAILED
            raise SessionFailed(code, f"POST /v1/realtime/calls: HTTP {r.status_code}: {r.text[:300]}")
        loc = r.headers.get("location")
        self.call_url = self.cfg.http_url(loc) if loc else None
        await pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))
        try:
            await asyncio.wait_for(opened, 20)
        except TimeoutError as e:
            raise SessionFailed(CONNECT_FAILED, "the oai-events data channel did not open within 20 s") from e

    async def _listen(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            now = self.loop.time()
            t = self.turn
            if t is None or t.done.is_set() or t.speech_end is None:
                continue
            pcm = frame.to_ndarray()  # [channels or 1, samples * channels] int16
            n = round(frame.samples * SAMPLE_RATE / frame.sample_rate)
            if t.first_audio is None and int(np.abs(pcm).max(initial=0)) < AUDIBLE:
                continue  # silence before the answer
            if t.audio_stopped:
                continue
            self.on_audio(now, n)

    def on_event(self, evt: Any, now: float) -> None:
        t = self.turn
        etype = evt.get("type") if isinstance(evt, dict) else None
        if t is None or t.done.is_set() or etype not in ("response.done", "output_audio_buffer.started",
                                                         "output_audio_buffer.stopped"):
            super().on_event(evt, now)
            return
        if etype == "output_audio_buffer.started":
            t.audio_started = True
        elif etype == "output_audio_buffer.stopped":
            t.audio_stopped = True
            if t.pending_done is not None:
                super().on_event(t.pending_done[0], now)
        else:
            # The track plays the answer after the engine finished it: the turn ends when its audio has stopped.
            t.pending_done = (evt, now)
            if t.audio_stopped:
                super().on_event(evt, now)
            elif not t.audio_started:
                self.loop.call_later(NO_AUDIO_GRACE_S, self._done_without_audio, t)

    def _done_without_audio(self, t: Any) -> None:
        if t is self.turn and not t.done.is_set() and not t.audio_started and t.pending_done is not None:
            super().on_event(*t.pending_done)

    async def before_commit(self) -> None:
        await asyncio.sleep(COMMIT_DELAY_S)

    async def send_event(self, evt: dict[str, Any]) -> None:
        if self.channel is None or self.channel.readyState != "open":
            raise SessionFailed(CONNECT_FAILED, "the oai-events data channel is not open")
        self.channel.send(json.dumps(evt))

    async def send_mic_frame(self, msg: Any) -> None:
        raise NotImplementedError("the WebRTC microphone is a track; frames are pulled by next_mic_frame")

    async def close(self) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        if self.call_url:
            try:
                async with httpx.AsyncClient(timeout=5) as http:
                    await http.post(self.call_url + "/hangup", headers=self.cfg.auth_headers)
            except httpx.HTTPError:
                pass  # the peer connection closing below ends the call as well
        if self.pc is not None:
            await self.pc.close()
