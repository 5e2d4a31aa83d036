"""Settings from the environment and `moss-speech serve` flags; structured log lines."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
from pydantic import ValidationError

from moss_speech.commands import serve
from server.limits import workers_advice
from server.ops.logs import _Formatter
from server.settings import Settings


def test_env_lists_and_flags_override(monkeypatch):
    monkeypatch.setenv("MOSS_API_KEYS", "k1, k2")
    monkeypatch.setenv("MOSS_ALLOWED_ORIGINS", '["https://a.example"]')
    monkeypatch.setenv("MOSS_MAX_SESSIONS", "5")
    monkeypatch.setenv("MOSS_PORT", "9000")
    s = Settings()
    assert s.api_keys == ["k1", "k2"] and s.allowed_origins == ["https://a.example"] and s.max_sessions == 5
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--port", "8123", "--api-key", "x", "--no-spawn-engine", "--engine-endpoint", "tcp://h:1"])
    s = Settings(**{k: v for k, v in vars(args).items() if v is not None})
    assert (s.port, s.api_keys, s.spawn_engine, s.engine_endpoint) == (8123, ["x"], False, "tcp://h:1")
    assert s.max_sessions == 5  # from the environment, no flag given
    assert s.resolved_endpoint() == "tcp://h:1"


def test_bad_settings_are_refused_by_name(monkeypatch, capsys):
    with pytest.raises(ValidationError, match="max_sessions"):
        Settings(max_sessions=0)
    with pytest.raises(ValidationError, match="no_such"):
        Settings(no_such=1)
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert serve.run(p.parse_args(["--max-message-bytes", "10"])) == 2
    assert "MOSS_MAX_MESSAGE_BYTES: Input should be greater than or equal to 1024" in capsys.readouterr().err


def test_each_log_line_names_its_session():
    rec = logging.LogRecord("server.session.session", logging.INFO, __file__, 1, "response done id=%s", ("r1",), None)
    rec.session_id = "sess_1"
    line = _Formatter("kv").format(rec)
    assert "session_id=sess_1" in line and 'msg="response done id=r1"' in line
    assert json.loads(_Formatter("json").format(rec))["session_id"] == "sess_1"
    plain = logging.LogRecord("server.engine", logging.INFO, __file__, 1, "ready", (), None)
    assert "session_id=-" in _Formatter("kv").format(plain)


def test_random_weights_flag_covers_both_random_presets_and_the_codec():
    from server.settings import Settings

    assert Settings(model="full-random", codec="/models/codec").random_weights
    assert Settings(model="/models/moss", codec="tiny-random").random_weights
    assert not Settings(model="/models/moss", codec="/models/codec").random_weights


def test_vocoder_reaches_the_engine_command(monkeypatch):
    from server.engine_client import engine_command

    monkeypatch.setenv("MOSS_VOCODER", "hift")
    s = Settings()
    cmd = engine_command(s.model, s.codec, "cpu", "ipc:///tmp/x", s.vocoder)
    assert cmd[cmd.index("--vocoder") + 1] == "hift"
    assert "--vocoder" not in engine_command("tiny-random", "tiny-random", "cpu", "ipc:///tmp/x")  # engine default
    with pytest.raises(ValidationError, match="vocoder"):
        Settings(vocoder="wavenet")


def test_serve_warns_when_the_session_limit_outgrows_its_server_processes():
    """One process's loop carries ~100 real-time sessions; a larger limit with too few workers gets a warning that
    names the --workers to use."""
    assert workers_advice(64, 1) is None
    assert workers_advice(300, 3) is None
    advice = workers_advice(256, 1)
    assert advice is not None and "--workers 3" in advice and "max_sessions 256" in advice
