"""WebRTC transport: an aiortc client calls the server, speaks a WAV, hears the answer; errors and lifecycle.

The server runs the real Session, VAD (Silero) and WebRTC code on loopback; the engine is the scripted one
from tests/server/transports/webrtc_support.py (a tone answer), so what is checked here is the transport: Opus both
ways,
resampling, pacing, events on the data channel, the call's lifecycle and its documented errors.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time

import httpx
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from engines.protocol import messages as m
from server.audio.pcm import float32_to_pcm16, pcm16_to_float32, read_wav
from server.audio.resample import resample
from server.transports.webrtc.config import WebRTCConfig, WebRTCConfigError, parse_ice_servers
from server.transports.webrtc.tracks import FRAME_SAMPLES, OPUS_RATE, OutboundAudioTrack, frame_to_mono
from tests.server.transports.webrtc_support import (
    CHUNK_SAMPLES,
    SPEECH_WAV,
    FakeSettings,
    ScriptedEngine,
    ServerThread,
    build_app,
)

SILENT_RMS = 0.003  # same threshold as the page (client_web/app.js LEVEL_THRESHOLD)


# ---- a client ---------------------------------------------------------------------------------


class WavMicTrack(MediaStreamTrack):
    """A fake microphone: the WAV at real time in 20 ms frames (48 kHz), then silence."""

    kind = "audio"

    def __init__(self, path, lead_silence_s: float = 0.5) -> None:
        super().__init__()
        x, _ = read_wav(path, target_rate=OPUS_RATE)
        self._pcm = np.concatenate([np.zeros(int(lead_silence_s * OPUS_RATE), np.float32), x])
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


@pytest.fixture
def engine():
    return ScriptedEngine()


# ---- end to end -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_spoken_turn_over_webrtc_then_hangup_frees_the_peer(engine):
    app = build_app(engine)
    svc = app.state.webrtc
    with ServerThread(app) as srv:
        async with httpx.AsyncClient(timeout=10) as http:
            mic = WavMicTrack(SPEECH_WAV)
            client = Client(srv.url, mic)
            await client.connect(http)
            await client.wait_event("session.created", 10)
            assert len(svc.calls) == 1 and len(app.state.sessions) == 1

            await client.wait_event("input_audio_buffer.speech_started", 10)
            t_stop, _ = await client.wait_event("input_audio_buffer.speech_stopped", 10)
            await client.wait_event("response.created", 5)
            _, started = await client.wait_event("output_audio_buffer.started", 10)
            _, done = await client.wait_event("response.done", 10)
            await client.wait_event("output_audio_buffer.stopped", 10)
            await client.frames_through(svc.calls.get(client.call_id))  # the last frames were still in flight

            # The user's speech reached the engine as 16 kHz PCM, then the turn was committed.
            assert engine.count(m.CommitUserAudio) == 1
            assert 1.0 < engine.user_audio_seconds() < 6.0
            # The answer came back as audio on the track: about the scripted length, at the scripted pitch.
            t_first = client.first_audible_after(float("-inf"))  # (the track was silent until the answer)
            assert t_first is not None, "no audible answer frame arrived"
            ttfa_ms = (t_first - t_stop) * 1000
            answer = client.audio_after(t_first)
            audible_s = sum(client.loud()) * FRAME_SAMPLES / OPUS_RATE
            expected_s = engine.chunks * CHUNK_SAMPLES / 24000
            assert abs(audible_s - expected_s) < 0.25, (audible_s, expected_s)
            first_chunk = answer[: int(0.3 * OPUS_RATE)]
            assert abs(dominant_hz(first_chunk, OPUS_RATE) - 330.0) < 15.0
            assert started["response_id"] == done["response"]["id"]
            print(f"\nWebRTC TTFA (speech_stopped event -> first audible frame at the client): {ttfa_ms:.0f} ms; "
                  f"server-side ttfa_ms: {done['response']['moss']['ttfa_ms']}")

            # Hang up: the call, its session and its peer are gone.
            server_pc = svc.calls.get(client.call_id).pc
            r = await http.post(f"{srv.url}/v1/realtime/calls/{client.call_id}/hangup")
            assert r.status_code == 204
            assert len(svc.calls) == 0
            await wait_until(lambda: len(app.state.sessions) == 0, 30, "session closed")
            assert server_pc.connectionState == "closed"
            assert engine.count(m.CloseSession) == 1
            r = await http.get(f"{srv.url}/v1/realtime/calls/{client.call_id}")
            assert r.status_code == 404
            await client.close()


@pytest.mark.timeout(60)
async def test_typed_turn_and_peer_close_without_hangup(engine):
    """A text turn over the data channel gets spoken audio back; closing the peer alone also frees the call."""
    app = build_app(engine)
    svc = app.state.webrtc
    with ServerThread(app) as srv:
        async with httpx.AsyncClient(timeout=10) as http:
            client = Client(srv.url, mic=None)
            await client.connect(http)
            await client.wait_event("session.created", 10)
            client.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
            await client.wait_event("session.updated", 5)
            t0 = time.monotonic()
            client.send({"type": "conversation.item.create",
                         "item": {"type": "message", "role": "user",
                                  "content": [{"type": "input_text", "text": "hello"}]}})
            client.send({"type": "response.create"})
            _, delta = await client.wait_event("response.output_audio_transcript.delta", 10)
            assert delta["delta"] == "scripted answer"
            await client.wait_event("output_audio_buffer.stopped", 10)
            await client.frames_through(svc.calls.get(client.call_id))
            assert client.first_audible_after(t0) is not None
            assert "response.output_audio.delta" not in client.types()  # audio goes on the track only
            assert any(isinstance(x, m.AddUserText) and x.text == "hello" for x in engine.received)

            # Malformed JSON on the channel is an error event; the call survives.
            client.channel.send("{not json")
            _, err = await client.wait_event("error", 5)
            assert err["error"]["code"] == "invalid_json"

            await client.close()  # no hang-up request: the server must notice the peer went away
            await wait_until(lambda: len(svc.calls) == 0, 15, "call freed after the client closed its peer")
            await wait_until(lambda: len(app.state.sessions) == 0, 30, "session closed")


@pytest.mark.timeout(60)
async def test_barge_in_clears_the_answer_audio(engine):
    engine.chunks, engine.chunk_gap_s = 20, 0.05  # an 8 s answer, produced faster than real time
    app = build_app(engine)
    with ServerThread(app) as srv:
        async with httpx.AsyncClient(timeout=10) as http:
            client = Client(srv.url, mic=None)
            await client.connect(http)
            await client.wait_event("session.created", 10)
            client.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
            client.send({"type": "conversation.item.create",
                         "item": {"type": "message", "role": "user",
                                  "content": [{"type": "input_text", "text": "talk"}]}})
            client.send({"type": "response.create"})
            await client.wait_event("output_audio_buffer.started", 10)
            await client.wait_event("response.done", 10)  # generation done: the whole answer is on the track
            call = app.state.webrtc.calls.get(client.call_id)
            await wait_until(lambda: any(client.loud()), 30, "the answer heard")
            queued_ms = call.track.buffered_ms  # (read before the clear)
            client.send({"type": "output_audio_buffer.clear"})
            await client.wait_event("output_audio_buffer.cleared", 10)
            n = call.track.stats.frames_sent  # every frame the track sends from here on comes after the clear
            await wait_until(lambda: len(client.frames) >= n + 10, 60, "frames after the clear")
            late = client.frames[n + 2:]  # (two frames for the codec's own tail)
            assert queued_ms > 1000 and late and not any(client.loud(late)), "audio kept playing"
            played_ms = call.track.played_samples_24k  # reset by clear
            assert played_ms == 0
            await client.close()


# ---- documented errors ------------------------------------------------------------------------


async def _offer_sdp() -> str:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def _asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=10)


@pytest.mark.parametrize("body,ctype,status,needle", [
    (b"hello", "application/sdp", 400, "v=0"),
    (b"", "application/sdp", 400, "empty"),
    (b"v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n", "application/sdp", 400, "no audio media section"),
    (b"\xff\xfe\x00", "application/sdp", 400, "UTF-8"),
    (b"v=0\r\n", "application/json", 415, "application/sdp"),
    (b"v=0\r\n" + b"a" * (70 * 1024), "application/sdp", 413, "limit"),
])
async def test_bad_offers_get_documented_errors(engine, body, ctype, status, needle):
    app = build_app(engine)
    async with _asgi(app) as http:
        r = await http.post("/v1/realtime/calls", content=body, headers={"Content-Type": ctype})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert len(app.state.webrtc.calls) == 0 and len(app.state.sessions) == 0


async def test_offer_without_opus_or_fingerprint_is_400(engine):
    good = await _offer_sdp()
    no_opus = good.replace("opus/48000/2", "speex/48000/2")
    no_fp = "\r\n".join(line for line in good.split("\r\n") if not line.startswith("a=fingerprint"))
    app = build_app(engine)
    async with _asgi(app) as http:
        for sdp, needle in ((no_opus, "Opus"), (no_fp, "fingerprint")):
            r = await http.post("/v1/realtime/calls", content=sdp, headers={"Content-Type": "application/sdp"})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


async def test_unknown_call_id_is_404(engine):
    app = build_app(engine)
    async with _asgi(app) as http:
        for method, path in (("GET", "/v1/realtime/calls/rtc_nope"), ("DELETE", "/v1/realtime/calls/rtc_nope"),
                             ("POST", "/v1/realtime/calls/rtc_nope/hangup"),
                             ("POST", "/v1/realtime/calls/rtc_nope/voice")):
            r = await http.request(method, path)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "call_not_found"


async def test_too_many_calls_is_503_until_one_hangs_up(engine):
    app = build_app(engine, FakeSettings(max_calls=1))
    async with _asgi(app) as http:
        headers = {"Content-Type": "application/sdp"}
        first = await http.post("/v1/realtime/calls", content=await _offer_sdp(), headers=headers)
        assert first.status_code == 201
        second = await http.post("/v1/realtime/calls", content=await _offer_sdp(), headers=headers)
        assert second.status_code == 503
        assert second.json()["error"]["code"] == "server_busy" and second.headers["retry-after"]
        assert len(app.state.sessions) == 1  # the refused call opened no session
        call_id = first.headers["location"].rsplit("/", 1)[1]
        assert (await http.delete(f"/v1/realtime/calls/{call_id}")).status_code == 204
        third = await http.post("/v1/realtime/calls", content=await _offer_sdp(), headers=headers)
        assert third.status_code == 201
        await app.state.webrtc.calls.close_all()
    assert len(app.state.sessions) == 0


async def test_session_limit_refuses_the_call_with_503(engine):
    app = build_app(engine, max_sessions=1)
    app.state.sessions.create()  # another transport holds the only session
    async with _asgi(app) as http:
        r = await http.post("/v1/realtime/calls", content=await _offer_sdp(),
                            headers={"Content-Type": "application/sdp"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
    assert len(app.state.webrtc.calls) == 0


async def test_api_key_and_origin_are_enforced(engine):
    app = build_app(engine, FakeSettings(api_keys=["k1"], allowed_origins=["https://good.example"]))
    sdp = await _offer_sdp()
    async with _asgi(app) as http:
        r = await http.post("/v1/realtime/calls", content=sdp, headers={"Content-Type": "application/sdp"})
        assert r.status_code == 401
        r = await http.post("/v1/realtime/calls", content=sdp, headers={
            "Content-Type": "application/sdp", "Authorization": "Bearer k1", "Origin": "https://evil.example"})
        assert r.status_code == 403
        r = await http.post("/v1/realtime/calls", content=sdp, headers={
            "Content-Type": "application/sdp", "Authorization": "Bearer k1", "Origin": "https://good.example"})
        assert r.status_code == 201
        await app.state.webrtc.calls.close_all()


async def test_ice_timeout_frees_the_call(engine):
    """A client that never completes ICE (it never applies the answer) is dropped after ice_timeout_s."""
    app = build_app(engine, FakeSettings(ice_timeout_s=1.0))
    async with _asgi(app) as http:
        r = await http.post("/v1/realtime/calls", content=await _offer_sdp(),
                            headers={"Content-Type": "application/sdp"})
        assert r.status_code == 201
        assert len(app.state.webrtc.calls) == 1
        await wait_until(lambda: len(app.state.webrtc.calls) == 0, 30, "ICE timeout")
        await wait_until(lambda: len(app.state.sessions) == 0, 30, "session closed")


async def test_session_end_closes_the_call(engine):
    app = build_app(engine)
    async with _asgi(app) as http:
        r = await http.post("/v1/realtime/calls", content=await _offer_sdp(),
                            headers={"Content-Type": "application/sdp"})
        call = app.state.webrtc.calls.get(r.headers["location"].rsplit("/", 1)[1])
        await call.session.close("engine_lost", 1011)
        await wait_until(lambda: call.closed, 30, "call closed")
        assert call.pc.connectionState == "closed" and len(app.state.webrtc.calls) == 0


async def test_info_reports_random_weights_and_ice_servers(engine):
    ice = [{"urls": "stun:stun.example.org:3478"},
           {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "p"}]
    app = build_app(engine, FakeSettings(ice_servers=ice))
    async with _asgi(app) as http:
        info = (await http.get("/v1/info")).json()
        page = await http.get("/")
        js = await http.get("/web/app.js")
    assert info["random_weights"] is True and info["model"] == "moss-speech"
    assert info["ice_servers"] == [{"urls": ["stun:stun.example.org:3478"]},
                                   {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "p"}]
    assert page.status_code == 200 and "MOSS-Speech" in page.text and "web/app.js" in page.text
    assert js.status_code == 200 and "__mossStats" in js.text


def test_ice_server_config_is_validated():
    assert parse_ice_servers('[{"urls": "stun:a:1"}]')[0].urls == ("stun:a:1",)
    with pytest.raises(WebRTCConfigError, match="username"):
        parse_ice_servers([{"urls": "turn:a:1"}])
    with pytest.raises(WebRTCConfigError, match="must start with"):
        parse_ice_servers([{"urls": "http://a"}])
    with pytest.raises(WebRTCConfigError, match="JSON"):
        parse_ice_servers("[{")
    with pytest.raises(WebRTCConfigError, match="ice_timeout_s"):
        WebRTCConfig(ice_timeout_s=0)
    # An empty list stays empty: aiortc would otherwise use a public STUN server.
    assert WebRTCConfig().rtc_configuration().iceServers == []


# ---- the outbound track, frame by frame ---------------------------------------------------------


def _tone(n: int, hz: float = 440.0) -> bytes:
    return float32_to_pcm16(0.5 * np.sin(2 * np.pi * hz * np.arange(n) / 24000.0))


def test_outbound_track_resamples_primes_and_reports():
    started, stopped, played = [], [], []
    tr = OutboundAudioTrack(prebuffer_ms=60, on_started=started.append, on_stopped=stopped.append,
                            on_played=lambda rid, n: played.append(n))
    silence = bytes(FRAME_SAMPLES * 2)
    assert tr.pull() == silence  # idle: silence frames
    pcm = _tone(2400)  # 100 ms
    tr.push("r1", pcm[: 2400])  # 50 ms: below the 60 ms jitter buffer
    assert tr.pull() == silence and not started
    tr.push("r1", pcm[2400:])
    frames = [tr.pull() for _ in range(3)]  # 60 of the 100 ms (the resampler holds a few ms back)
    assert started == ["r1"] and all(f != silence for f in frames)
    tr.end_response("r1")
    out = b"".join(frames)
    while tr.response_id is not None:
        out += tr.pull()
    assert stopped == ["r1"]
    # What left equals the whole-signal 24 -> 48 kHz conversion of what went in (streaming == offline).
    ref = resample(pcm16_to_float32(pcm), 24000, 48000)
    got = pcm16_to_float32(out)[: len(ref)]
    assert np.max(np.abs(got - ref)) < 2e-3
    assert played[-1] == 2400  # cumulative, in 24 kHz samples


def test_outbound_track_underrun_and_clear():
    tr = OutboundAudioTrack(prebuffer_ms=0)
    silence = bytes(FRAME_SAMPLES * 2)
    tr.push("r1", _tone(960))  # 40 ms
    assert tr.pull() != silence
    # The resampler holds back a few samples, so the second 20 ms may be short: either way, once the buffer
    # is dry before the answer ends, the track sends silence and counts an underrun.
    while tr.pull() != silence:
        pass
    assert tr.stats.underruns == 1
    tr.push("r1", _tone(4800))
    tr.pull()
    rid, played = tr.clear()
    assert rid == "r1" and played > 0
    assert tr.pull() == silence and tr.response_id is None
    tr.push("r2", _tone(4800))  # a new answer starts clean
    assert tr.pull() != silence and tr.response_id == "r2"


def test_frame_to_mono_downmixes_stereo_s16():
    frame = AudioFrame(format="s16", layout="stereo", samples=4)
    left_right = np.array([[1000, -1000], [2000, 0], [0, 0], [-32768, -32768]], dtype="<i2")
    frame.planes[0].update(left_right.tobytes())
    frame.sample_rate = 48000
    np.testing.assert_allclose(frame_to_mono(frame), [0.0, 1000 / 32768, 0.0, -1.0], atol=1e-6)


# ---- in the real app: control WebSocket bound to a call --------------------------------------------


@pytest.mark.timeout(90)
async def test_control_websocket_bound_to_a_call_in_the_real_app():
    """The app factory with the engine process (scripted fake): events mirrored to `/v1/realtime?call_id=`,
    a turn driven from that socket is answered on the call's audio track."""
    import websockets

    from tests.fakes.harness import RunningServer, fake_settings, recv_until, send

    srv = await asyncio.to_thread(lambda: RunningServer(fake_settings()).__enter__())
    try:
        await asyncio.to_thread(srv.wait_engine)
        async with httpx.AsyncClient(timeout=10) as http:
            info = (await http.get(srv.http + "/v1/info")).json()
            assert info["random_weights"] is True
            client = Client(srv.http, mic=None)
            await client.connect(http)
            await client.wait_event("session.created", 10)
            with pytest.raises(websockets.InvalidStatus) as bad:
                async with websockets.connect(srv.ws + "?call_id=rtc_unknown"):
                    pass
            assert bad.value.response.status_code == 404
            async with websockets.connect(f"{srv.ws}?call_id={client.call_id}") as ws:
                await send(ws, "session.update", session={"audio": {"input": {"turn_detection": None}}})
                await recv_until(ws, "session.updated", 10)
                await client.wait_event("session.updated", 5)  # the data channel sees the same events
                t0 = time.monotonic()
                await send(ws, "conversation.item.create", item={
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
                await send(ws, "response.create")
                events = await recv_until(ws, "response.done", 20)
                assert not any(e["type"] == "response.output_audio.delta" for e in events)
                await client.wait_event("output_audio_buffer.stopped", 10)
                await client.frames_through(srv.app.state.calls.get(client.call_id))
                assert client.first_audible_after(t0) is not None
                r = await http.delete(f"{srv.http}/v1/realtime/calls/{client.call_id}")
                assert r.status_code == 204
                assert len(srv.app.state.calls) == 0
                with pytest.raises(websockets.ConnectionClosedOK):  # the call ended: so does its control socket
                    while True:
                        await asyncio.wait_for(ws.recv(), 10)
            await client.close()
    finally:
        await asyncio.to_thread(srv.__exit__, None, None, None)


async def test_idle_live_mic_under_server_vad_never_hits_the_input_buffer_limit():
    """A WebRTC mic streams silence between turns; under server_vad that is not buffered input, so the
    uncommitted-audio limit must not end a call after a quiet minute (here: a 1 s limit, 3 s of silence)."""
    from server.session.session import Session, SessionLimits
    from tests.server.transports.webrtc_support import vad_factory

    s = Session("s1", ScriptedEngine(), limits=SessionLimits(max_input_buffer_seconds=1.0), audio_out="track",
                vad_factory=vad_factory)
    await s.start()
    for _ in range(150):
        await s.feed_audio(np.zeros(320, np.float32), 16000)
    # Push-to-talk (no VAD) does buffer everything, and the limit applies.
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    from server.session.client_events import ProtocolError

    with pytest.raises(ProtocolError, match="exceed"):
        for _ in range(150):
            await s.feed_audio(np.zeros(320, np.float32), 16000)
    await s.close()


async def test_voice_prompt_upload_reaches_the_engine(engine):
    app = build_app(engine)
    wav = SPEECH_WAV.read_bytes()
    async with _asgi(app) as http:
        r = await http.post("/v1/realtime/calls", content=await _offer_sdp(),
                            headers={"Content-Type": "application/sdp"})
        call_id = r.headers["location"].rsplit("/", 1)[1]
        bad = await http.post(f"/v1/realtime/calls/{call_id}/voice", content=b"not a wav",
                              headers={"Content-Type": "audio/wav"})
        assert bad.status_code == 400 and "WAV" in bad.json()["error"]["message"]
        ok = await http.post(f"/v1/realtime/calls/{call_id}/voice", content=wav, headers={"Content-Type": "audio/wav"})
        assert ok.status_code == 204
        updates = [x for x in engine.received if isinstance(x, m.UpdateSession)]
        assert len(updates) == 1 and updates[0].voice_wav == wav
        await app.state.webrtc.calls.close_all()
