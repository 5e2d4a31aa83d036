"""The WebRTC audio tracks on their own: the paced outbound answer track (resampling, priming, underruns, clear) and
the inbound downmix."""

from __future__ import annotations

import numpy as np
from av import AudioFrame

from server.audio.pcm import float32_to_pcm16, pcm16_to_float32
from server.audio.resample import resample
from server.transports.webrtc.tracks import FRAME_SAMPLES, OutboundAudioTrack, frame_to_mono


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
