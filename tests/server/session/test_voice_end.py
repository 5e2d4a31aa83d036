"""Where the voice ended: a pause's silence counts the windows Silero still called speech after the voice had fallen
silent, at most two and only while no louder window follows them; a turn then ends `silence_duration_ms` after the
voice, not the VAD's lag later."""

from __future__ import annotations

import numpy as np

from server.session.voice_end import BACK_WINDOWS, QUIET_DB, VoiceEnd, level_db
from tests.server.session.session_support import drain, feed, new_session, silence
from tests.server.session.turn_model_fakes import voice24k

WIN = 512


def _window(db: float) -> np.ndarray:
    """A 16 kHz window whose level is `db` (a square wave of that RMS; -inf: digital silence)."""
    if db == float("-inf"):
        return np.zeros(WIN, np.float32)
    return np.where(np.arange(WIN) % 2, 1.0, -1.0).astype(np.float32) * np.float32(10 ** (db / 20))


def _heard(*levels: float) -> VoiceEnd:
    v = VoiceEnd()
    v.start(_window(levels[0]))
    for db in levels[1:]:
        v.speech(_window(db))
    return v


def test_levels_are_the_windows_rms_in_db():
    assert abs(level_db(_window(-20.0)) + 20.0) < 1e-4 and level_db(_window(float("-inf"))) == float("-inf")


def test_the_speech_windows_already_quiet_before_the_vads_silence_are_counted():
    assert _heard(-10, -12, -70, -80).quiet_windows() == 2
    assert _heard(-10, -12, -20, -80).quiet_windows() == 1
    assert _heard(-10, -12, -20, -25).quiet_windows() == 0  # the voice went on to the VAD's silence


def test_never_more_than_two_nor_past_a_louder_window():
    assert _heard(-10, -90, -90, -90, -90).quiet_windows() == BACK_WINDOWS == 2
    assert _heard(-10, -90, -15, -90).quiet_windows() == 1


def test_a_noisy_room_whose_level_never_falls_that_far_counts_as_before():
    floor = -10 - QUIET_DB + 5
    assert _heard(-10, floor, floor).quiet_windows() == 0


def test_windows_before_a_pause_are_not_the_next_pauses():
    v = _heard(-10, -90)  # the VAD's silence came here; then speech again
    v.resumed()
    v.speech(_window(-12))
    assert v.quiet_windows() == 0


async def test_a_server_vad_turn_ends_its_silence_after_the_voice_not_the_vads_lag_later():
    """The sample's voice, then digital silence: Silero calls the first two silent windows speech (its lag), and the
    turn ends 300 ms of silence after the voice (rounded to whole windows and their alignment), where counting from
    the VAD's own silence ended it 64 ms later."""
    s, _ = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "silence_duration_ms": 300}}}}})
    drain(s)
    voice = voice24k()
    await feed(s, np.concatenate([silence(0.5), voice, silence(1.0)]))
    (stop,) = [e for e in drain(s) if e["type"] == "input_audio_buffer.speech_stopped"]
    voice_end_ms = 500 + len(voice) * 1000 // 24000
    assert 300 <= stop["audio_end_ms"] - voice_end_ms <= 300 + 32 + 32, stop["audio_end_ms"] - voice_end_ms
