"""A voice prompt whose WAV header claims a sample rate out of range, or a length under 80 ms or over 30 s, is refused
by the server with `invalid_audio` naming the parameter, before the engine sees it."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from engines.audio.wav import write_wav
from server.session.client_events import SessionConfig, parse_session_update


def _update(wav: bytes) -> dict:
    return {"moss": {"voice_prompt": {"wav": base64.b64encode(wav).decode()}}}


@pytest.mark.parametrize(("rate", "seconds", "why"), [(400, 975.0, "sample rate 400 Hz"),
                                                      (8_000, 31.0, "longer than 30 s"),
                                                      (24_000, 0.01, "shorter than 80 ms")])
def test_a_prompt_out_of_bounds_is_refused_by_name(tmp_path, rate: int, seconds: float, why: str) -> None:
    path = tmp_path / "v.wav"
    write_wav(path, np.zeros(int(rate * seconds), np.float32), rate)
    assert path.stat().st_size < 1 << 20
    new, refused = parse_session_update(_update(path.read_bytes()), SessionConfig())
    assert [(e.code, e.param) for e in refused] == [("invalid_audio", "session.moss.voice_prompt.wav")]
    assert why in refused[0].message and new.voice_prompt_wav is None
    write_wav(path, np.zeros(16000, np.float32), 16000)
    new, refused = parse_session_update(_update(path.read_bytes()), SessionConfig())
    assert refused == [] and new.voice_prompt_wav == path.read_bytes()
