"""WebRTC calls end to end: an aiortc client calls the server, speaks a WAV, hears the answer, barges in, types, binds a
control WebSocket, uploads a voice.

The server runs the real Session, VAD (Silero) and WebRTC code on loopback; the engine is the scripted one
from tests/server/transports/webrtc_support.py (a tone answer), so what is checked here is the transport: Opus both
ways, resampling, pacing, events on the data channel (each validated under the openai SDK's models), the call's
lifecycle. Its HTTP errors and limits: test_webrtc_http.py; the tracks alone: test_webrtc_tracks.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from engines.protocol import messages as m
from server.transports.webrtc.tracks import FRAME_SAMPLES, OPUS_RATE
from tests.server.strict_events import check
from tests.server.transports.webrtc_client import (
    Client,
    WavMicTrack,
    asgi_client,
    dominant_hz,
    offer_sdp,
    wait_until,
)
from tests.server.transports.webrtc_support import (
    CHUNK_SAMPLES,
    SPEECH_WAV,
    ScriptedEngine,
    ServerThread,
    build_app,
)


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
            for _, e in client.events:
                check(e)
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


@pytest.mark.timeout(90)
async def test_vad_barge_in_cuts_the_answer_where_the_track_was_and_says_so_in_openais_order(engine):
    """The user speaks again while the answer plays: the server clears the track and truncates the answer at what it
    played, and sends input_audio_buffer.speech_started, output_audio_buffer.cleared, conversation.item.truncated in
    that order (as OpenAI's WebRTC server does). Every event the call sent validates under the SDK's models."""
    engine.chunks, engine.chunk_gap_s = 20, 0.05  # an 8 s answer, produced faster than real time
    app = build_app(engine)
    with ServerThread(app) as srv:
        async with httpx.AsyncClient(timeout=10) as http:
            client = Client(srv.url, WavMicTrack(SPEECH_WAV, again_after_s=2.0))
            await client.connect(http)
            await client.wait_event("output_audio_buffer.started", 30)
            await wait_until(lambda: client.types().count("input_audio_buffer.speech_started") == 2, 30,
                             "the second speech")
            _, truncated = await client.wait_event("conversation.item.truncated", 10)
            await wait_until(lambda: client.types().count("response.done") == 2, 30, "the second turn's answer")
            t = client.types()
            second = len(t) - 1 - t[::-1].index("input_audio_buffer.speech_started")
            after = [x for x in t[second:] if x in ("output_audio_buffer.cleared", "conversation.item.truncated")]
            assert after[:2] == ["output_audio_buffer.cleared", "conversation.item.truncated"], t
            cut = [x for x in engine.received if isinstance(x, m.TruncateResponse)][0]
            assert 0 < truncated["audio_end_ms"] == cut.audio_samples_played * 1000 // 24000 < 8000
            # Generated faster than real time, the answer had ended: only its playback was cut.
            interrupted = [e for _, e in client.events if e["type"] == "response.done"][0]["response"]
            assert truncated["item_id"] == interrupted["output"][0]["id"] and cut.response_id == interrupted["id"]
            for _, e in client.events:
                check(e)
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
            client.channel.send('{"type": "response.create", "response": ' + "[" * 5000 + "]" * 5000 + "}")
            errors = lambda: [e for _, e in client.events if e["type"] == "error"]  # noqa: E731
            await wait_until(lambda: len(errors()) == 2, 5, "an error for the nested message")
            assert errors()[1]["error"]["code"] == "invalid_json" and "deep" in errors()[1]["error"]["message"]

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
    from server.session.client_json import ProtocolError

    with pytest.raises(ProtocolError, match="exceed"):
        for _ in range(150):
            await s.feed_audio(np.zeros(320, np.float32), 16000)
    await s.close()


async def test_voice_prompt_upload_reaches_the_engine(engine):
    app = build_app(engine)
    wav = SPEECH_WAV.read_bytes()
    async with asgi_client(app) as http:
        r = await http.post("/v1/realtime/calls", content=await offer_sdp(),
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
