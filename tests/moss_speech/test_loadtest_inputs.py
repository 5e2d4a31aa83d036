"""What a load test starts from: its validated configuration and the session.update it sends, pauses put into
an utterance, and the utterance loaded, resampled to 24 kHz and trimmed."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from moss_speech.loadtest.audio import AudioError, Utterance, insert_pauses, load_utterance
from moss_speech.loadtest.config import LoadConfig, LoadConfigError
from moss_speech.loadtest.user import session_update_event
from tests.moss_speech.loadtest_support import _write_wav
from tests.paths import REPO


def test_config_validates_and_derives_urls():
    c = LoadConfig(url="https://example.org:8443/some/path", api_key="k")
    assert c.realtime_url == "wss://example.org:8443/v1/realtime"
    assert c.http_url("/health") == "https://example.org:8443/health"
    assert c.auth_headers == {"Authorization": "Bearer k"} and c.public_dict()["api_key"] == "***"
    assert LoadConfig(url="ws://h:1").http_url("/x") == "http://h:1/x"
    for bad, match in [({"url": "localhost:8000"}, "--url"), ({"sessions": 0}, "--sessions"),
                       ({"turn_detection": "semantic"}, "--turn-detection"), ({"frame_ms": 15}, "--frame-ms"),
                       ({"max_output_tokens": 0}, "--max-output-tokens")]:
        with pytest.raises(LoadConfigError, match=match):
            LoadConfig(**{"url": "http://h:1", **bad})


def test_config_takes_semantic_vad_and_pauses():
    c = LoadConfig(url="http://h:1", turn_detection="semantic_vad", eagerness="high", pauses_ms=(300, 700))
    assert c.vad and not LoadConfig(url="http://h:1", turn_detection="commit").vad
    for bad, match in [({"eagerness": "eager"}, "--eagerness"), ({"pauses_ms": (700, 300)}, "--pauses"),
                       ({"pauses_ms": (0, 300)}, "--pauses")]:
        with pytest.raises(LoadConfigError, match=match):
            LoadConfig(**{"url": "http://h:1", **bad})
    td = session_update_event(c)["session"]["audio"]["input"]["turn_detection"]
    assert td == {"type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": True}


def test_pauses_go_into_the_quiet_points_of_any_utterance():
    rate = 24000
    t = np.arange(4 * rate) / rate
    tone = (0.5 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    tone[rate:int(1.01 * rate)] = 0  # a quiet 10 ms in the first 1.2 s stretch after 0.3 s
    utt = Utterance(pcm=tone, source="tone")
    paused = insert_pauses(utt, 300, 700, seed=1)
    pcm = paused.pcm
    silent = np.abs(pcm[:len(pcm) // 240 * 240].reshape(-1, 240)).max(axis=1) == 0  # 10 ms windows
    runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], silent.astype(int), [0]]))))[::2] * 10  # ms
    assert len(runs) == 3 and all(300 <= r <= 710 for r in runs), runs  # 0.3-3.4 s: three stretches of 1.2 s
    assert np.flatnonzero(silent)[0] * 10 == 1000  # the first where the tone was quiet
    assert 3 * 300 * 24 <= len(pcm) - len(tone) <= 3 * 700 * 24  # only silence was added
    assert "with pauses of 300-700 ms" in paused.source
    assert np.array_equal(insert_pauses(utt, 300, 700, seed=1).pcm, pcm)  # seeded
    with pytest.raises(AudioError):
        insert_pauses(utt, 500, 100)
    data = load_utterance(REPO / "tests" / "data" / "speech_paused_en_16k.wav")
    assert 5.5 < data.duration_s < 6.5


def test_utterance_is_resampled_to_24k_and_trimmed(tmp_path):
    rate = 16000
    t = np.arange(rate) / rate
    x = np.concatenate([np.zeros(rate // 2), 0.5 * np.sin(2 * np.pi * 220 * t), np.zeros(rate // 2)])
    u = load_utterance(_write_wav(tmp_path / "a.wav", x, rate))
    assert u.duration_s == pytest.approx(1.0, abs=0.02)
    frames = u.frames_b64(20)
    assert len(frames) == -(-len(u.pcm) // 480)
    assert all(len(base64.b64decode(f)) == 960 for f in frames)
    with pytest.raises(AudioError, match="silent"):
        load_utterance(_write_wav(tmp_path / "s.wav", np.zeros(rate), rate))
    with pytest.raises(AudioError):
        load_utterance(tmp_path / "missing.wav")
