"""The load test's simulated user: event bookkeeping without a server, then the client against the real server
code with the scripted engine (fast, deterministic answers) over WebSocket and WebRTC, `bench capacity` with
worker processes, and a clear refusal where the server has no WebRTC endpoint."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from moss_speech.loadtest.audio import load_utterance
from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.report import build_report
from moss_speech.loadtest.results import Collector, TurnRecord
from moss_speech.loadtest.stats import PlaybackBuffer
from tests.moss_speech.loadtest_support import _write_wav


async def test_user_attributes_events_to_the_turn_answer():
    """Event bookkeeping without a server: an answer created mid-utterance is ignored, audio is counted only for
    the turn's own response, and a late chunk is an underrun."""
    from moss_speech.loadtest.user import SimulatedUser, _Turn

    c = Collector()
    cfg = LoadConfig(url="http://h:1", prebuffer_ms=0)
    user = SimulatedUser(cfg, 0, [], "", 1.0, c, run_t0=0.0, deadline=1e9)
    t = _Turn(rec=TurnRecord(session=0, turn=0), buf=PlaybackBuffer())
    user.turn = t
    delta = lambda rid, n: {"type": "response.output_audio.delta", "response_id": rid,
                            "delta": base64.b64encode(bytes(2 * n)).decode()}
    user.on_event({"type": "response.created", "response": {"id": "early"}}, 0.5)  # the user is still speaking
    user.on_event(delta("early", 480), 0.6)
    t.speech_end = 1.0
    user.on_event({"type": "input_audio_buffer.committed"}, 1.3)
    user.on_event({"type": "response.created", "response": {"id": "r1"}}, 1.31)
    user.on_event(delta("r1", 9600), 1.40)  # 400 ms
    user.on_event(delta("early", 480), 1.45)
    user.on_event(delta("r1", 9600), 1.80)  # on time
    user.on_event(delta("r1", 9600), 2.30)  # the buffer ran dry at 2.20: a 100 ms hole
    user.on_event({"type": "error", "error": {"code": "some_code", "message": "m"}}, 2.4)
    user.on_event({"type": "response.done", "response": {"id": "r1", "status": "completed",
                                                   "moss": {"ttfa_ms": 85.0}}}, 2.5)
    assert t.done.is_set() and t.response_id == "r1" and c.extra_responses == 1
    user._finish(t)
    (rec,) = c.records
    assert rec.deltas == 3 and rec.audio_s == pytest.approx(1.2)
    assert rec.ttfa_ms == pytest.approx(400.0) and rec.ttfa_commit_ms == pytest.approx(100.0)
    assert rec.vad_delay_ms == pytest.approx(300.0) and rec.server_ttfa_ms == 85.0
    assert rec.underruns == 1 and rec.stall_ms == pytest.approx(100.0)
    assert rec.gaps_ms == pytest.approx([400.0, 500.0]) and rec.rtf == pytest.approx(0.9 / 0.8)
    assert rec.status == "error" and rec.error_code == "some_code" and c.errors == {"some_code": 1}
    # The early answer was a false start the client saw, and its audio came while the user still spoke.
    assert rec.false_starts == 1 and rec.talked_over
    assert rec.heard_ms == pytest.approx(400.0)  # no prebuffer: heard as it arrived


async def test_user_times_each_transcript_from_its_commit():
    """--transcription: the session asks for input transcription; a transcript is matched to its turn by the
    committed item's id (it usually comes after the answer is done), a failed one is an error, and one still owed
    when the session ends is counted as missing."""
    from moss_speech.loadtest.user import SimulatedUser, _Turn, session_update_event

    cfg = LoadConfig(url="http://h:1", transcription=True)
    assert session_update_event(cfg)["session"]["audio"]["input"]["transcription"] == {"model": "moss-speech"}
    assert "transcription" not in session_update_event(LoadConfig(url="http://h:1"))["session"]["audio"]["input"]
    c = Collector()
    user = SimulatedUser(cfg, 0, [], "", 1.0, c, run_t0=0.0, deadline=1e9)
    recs = [TurnRecord(session=0, turn=k) for k in range(3)]
    for k, rec in enumerate(recs):
        t = _Turn(rec=rec, buf=PlaybackBuffer())
        t.speech_end = 10.0 * k
        user.turn = t
        user.on_event({"type": "input_audio_buffer.committed", "item_id": f"item{k}"}, 10.0 * k + 0.5)
        user.on_event({"type": "response.done", "response": {"id": None, "status": "completed"}}, 10.0 * k + 2)
    user.turn = None  # the transcripts arrive between turns
    user.on_event({"type": "conversation.item.input_audio_transcription.delta", "item_id": "item0", "delta": "hi"},
                  0.7)
    user.on_event({"type": "conversation.item.input_audio_transcription.completed", "item_id": "item0",
                   "transcript": "hi"}, 0.9)
    user.on_event({"type": "conversation.item.input_audio_transcription.failed", "item_id": "item1",
                   "error": {"message": "engine said no"}}, 11.0)
    user.on_event({"type": "conversation.item.input_audio_transcription.completed", "item_id": "other",
                   "transcript": "?"}, 12.0)  # not a turn of ours: ignored
    assert recs[0].transcript_ms == pytest.approx(400.0) and recs[1].transcript_ms is None
    user.deadline = user.loop.time()  # the run is over: no waiting for item2's transcript
    await user._await_transcripts()
    assert recs[2].transcript_ms is None
    assert c.errors == {"transcription_failed": 1, "no_transcript": 1}


@pytest.fixture(scope="module")
def short_wav(tmp_path_factory) -> Path:
    """0.4 s of tone: enough for commit-mode turns (no VAD involved), and quick to speak at real time."""
    rate = 16000
    t = np.arange(int(0.4 * rate)) / rate
    return _write_wav(tmp_path_factory.mktemp("wav") / "short.wav", 0.3 * np.sin(2 * np.pi * 220 * t), rate)


def _run_against(url: str, audio: Path | None = None, **kw):
    from moss_speech.loadtest.driver import run_load

    cfg = LoadConfig(url=url, **{"duration_s": 60.0, "think_ms": 100.0, **kw})
    utt = load_utterance(audio)
    collector, wall = run_load(cfg, utt, progress=False)
    return cfg, build_report(cfg, collector, wall, {"gpu": "unknown", "source": None}, utt)


@pytest.fixture(scope="module")
def scripted_server():
    from tests.fakes.harness import RunningServer, fake_settings

    with RunningServer(fake_settings(api_keys=["secret"])) as srv:
        srv.wait_engine()
        yield srv


def test_client_commit_turns_against_scripted_engine(scripted_server, short_wav):
    # The scripted engine answers every response with 4 chunks of 9600 samples (tests/fakes/fake_engine.py).
    _, rep = _run_against(scripted_server.http, short_wav, sessions=2, turns=2, turn_detection="commit",
                          api_key="secret")
    assert rep["errors"]["total"] == 0, rep["errors"]
    assert rep["turns"]["ok"] == 4 and rep["sessions"]["connected"] == 2
    for r in rep["turn_records"]:
        assert r["deltas"] == 4 and r["audio_s"] == pytest.approx(4 * 9600 / 24000)
        assert r["ttfa_ms"] == r["ttfa_commit_ms"] and r["ttfa_ms"] > 0
        assert r["server_ttfa_ms"] is not None and r["response_status"] == "completed"


def test_client_server_vad_turn_against_scripted_engine(scripted_server):
    _, rep = _run_against(scripted_server.http, sessions=1, turns=1, api_key="secret")
    assert rep["errors"]["total"] == 0, rep["errors"]
    (r,) = rep["turn_records"]
    assert r["status"] == "ok" and r["vad_delay_ms"] > 0
    # From speech end, TTFA contains the VAD's wait for silence; from the commit it does not.
    assert r["ttfa_ms"] == pytest.approx(r["vad_delay_ms"] + r["ttfa_commit_ms"], abs=1e-6)


def test_client_counts_refused_connections_as_errors(scripted_server, short_wav):
    _, rep = _run_against(scripted_server.http, short_wav, sessions=2, turns=1, api_key="wrong")
    assert rep["errors"]["by_code"] == {"connect_failed": 2}
    assert "HTTP 401" in rep["errors"]["samples"]["connect_failed"]
    assert rep["sessions"]["connected"] == 0 and rep["turns"]["recorded"] == 0


def test_client_webrtc_commit_turn_against_scripted_engine(scripted_server, short_wav):
    _, rep = _run_against(scripted_server.http, short_wav, sessions=1, turns=1, turn_detection="commit",
                          transport="webrtc", api_key="secret")
    assert rep["errors"]["total"] == 0, rep["errors"]
    assert rep["turns"]["ok"] == 1
    for r in rep["turn_records"]:
        # Heard on the track between the first audible frame and output_audio_buffer.stopped: about the 1.6 s sent.
        assert 1.2 <= r["audio_s"] <= 1.7 and r["ttfa_ms"] > 0 and r["response_status"] == "completed"


def test_capacity_cli_with_worker_processes(scripted_server, short_wav, tmp_path):
    from moss_speech.cli import main

    out = tmp_path / "cap.json"
    # A budget no CI machine misses: this checks the level loop, worker processes and the report, not speed.
    rc = main(["bench", "capacity", "--url", scripted_server.http, "--api-key", "secret", "--start", "1", "--max", "2",
               "--turns", "1", "--turn-detection", "commit", "--audio", str(short_wav), "--workers", "2",
               "--ttfa-budget-ms", "60000",
               "--think-ms", "0", "--quiet", "--json", str(out), "--plots", str(tmp_path)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["capacity"] == 2 and d["capacity_is_lower_bound"] is True
    assert d["vad_lag_budget_ms"] is None  # commit mode: no VAD criterion
    assert [(p["sessions"], p["turns"]["ok"], p["errors"]["total"]) for p in d["curve"]] == [(1, 1, 0), (2, 2, 0)]
    assert (tmp_path / "capacity.png").is_file() and (tmp_path / "ttfa_cdf.png").is_file()


def test_webrtc_is_refused_clearly_without_the_endpoint(capsys):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        from moss_speech.cli import main

        rc = main(["loadtest", "--url", f"http://127.0.0.1:{httpd.server_port}", "--transport", "webrtc"])
    finally:
        httpd.shutdown()
    assert rc == 2
    assert "no WebRTC endpoint (POST /v1/realtime/calls answered 404)" in capsys.readouterr().err
