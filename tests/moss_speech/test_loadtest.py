"""Load test: stats and underrun accounting (no server), the client against the server with the scripted engine,
and the CI smoke run against `moss-speech serve` with the tiny model."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import types
import wave
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from moss_speech.loadtest import capacity
from moss_speech.loadtest.audio import AudioError, Utterance, insert_pauses, load_utterance
from moss_speech.loadtest.config import LoadConfig, LoadConfigError
from moss_speech.loadtest.report import METRICS, build_report, format_table
from moss_speech.loadtest.results import Collector, TurnRecord
from moss_speech.loadtest.stats import PlaybackBuffer, b64_decoded_len, percentile, percentile_interval, summarize
from moss_speech.loadtest.user import session_update_event
from tests.fakes.harness import free_port
from tests.paths import REPO

# ---- stats ------------------------------------------------------------------------------------------------------

def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(100.0, n).tolist()
        for q in (0, 50, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="in \\[0, 100\\]"):
        percentile([1.0], 101)


def test_summarize_ignores_none_and_reports_empty():
    s = summarize([None, 3.0, 1.0, 2.0])
    assert (s["count"], s["mean"], s["p50"], s["max"], s["p95_ci"]) == (3, 2.0, 2.0, 3.0, None)  # (too few for it)
    assert summarize([None]) == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None,
                                 "p95_ci": None}
    lo, hi = summarize(list(range(240)))["p95_ci"]
    assert lo <= percentile(range(240), 95) <= hi


def test_percentile_interval_ranks_come_from_the_binomial_tails():
    """Values 1..n, so each bound is its own rank: the lower one is the highest rank r with P(K <= r - 1) <= 5% and
    the upper one the lowest s with P(K <= s - 1) >= 95%, K ~ binomial(n, 0.95)."""
    from scipy.stats import binom

    for n in (59, 100, 240, 1000):
        lo, hi = percentile_interval(range(1, n + 1), 95)
        cdf = binom.cdf(np.arange(n), n, 0.95)  # cdf[r - 1] = P(K <= r - 1)
        assert lo == max(r for r in range(1, n + 1) if cdf[r - 1] <= 0.05)
        assert hi == min(s for s in range(1, n + 1) if cdf[s - 1] >= 0.95)
    assert percentile_interval(range(58), 95) is None  # p95 at 90% needs 59 draws
    assert percentile_interval([], 95) is None
    with pytest.raises(ValueError, match="percentile"):
        percentile_interval([1.0], 100)
    with pytest.raises(ValueError, match="confidence"):
        percentile_interval([1.0], 95, confidence=1.0)


def test_percentile_interval_covers_the_true_percentile_about_as_often_as_it_says():
    rng = np.random.default_rng(7)
    trials = 1000
    covered = sum(lo <= 0.95 <= hi for lo, hi in (percentile_interval(rng.random(240), 95) for _ in range(trials)))
    assert 0.88 <= covered / trials <= 0.97  # at least 90% by construction (ranks are whole: a little over)


def _play(schedule: list[tuple[float, float]], prebuffer_s: float = 0.0, done_at: float | None = None):
    """schedule: (arrival time, chunk seconds) at 24 kHz."""
    buf = PlaybackBuffer(prebuffer_s=prebuffer_s)
    for t, dur in schedule:
        buf.on_audio(t, round(dur * 24000))
    end = buf.finish(done_at if done_at is not None else schedule[-1][0])
    return buf, end


def test_playback_real_time_arrivals_never_underrun():
    # 400 ms chunks arriving every 400 ms: each lands exactly as the previous one finishes playing.
    buf, end = _play([(1.0 + 0.4 * i, 0.4) for i in range(10)])
    assert buf.underruns == 0 and buf.stall_s == 0
    assert buf.min_lead_s == pytest.approx(0.0, abs=1e-9)
    assert buf.started_at == 1.0 and end == pytest.approx(5.0)
    assert buf.audio_s == pytest.approx(4.0)


def test_playback_late_chunk_is_one_underrun_with_its_stall():
    # Chunk 3 arrives 150 ms after the buffer ran dry; chunk 4 is on time again relative to the resumed playback.
    buf, end = _play([(0.0, 0.4), (0.4, 0.4), (0.95, 0.4), (1.3, 0.4)])
    assert buf.underruns == 1
    assert buf.stall_s == pytest.approx(0.15)
    assert end == pytest.approx(0.95 + 0.8)


def test_playback_prebuffer_absorbs_jitter_that_would_underrun_without_it():
    # 20 ms frames sent at real time, every third one delayed by 30 ms; over TCP the ones behind it wait too.
    sched, t = [], 0.0
    for i in range(60):
        t = max(t, 0.02 * i + (0.03 if i % 3 == 2 else 0.0))
        sched.append((t, 0.02))
    no_buf, _ = _play(sched, prebuffer_s=0.0)
    with_buf, _ = _play(sched, prebuffer_s=0.06)
    assert no_buf.underruns > 0
    assert with_buf.underruns == 0
    assert with_buf.started_at == pytest.approx(0.07)  # the third (late) frame fills the 60 ms


def test_playback_starts_at_response_end_when_prebuffer_never_fills():
    buf, end = _play([(2.0, 0.02)], prebuffer_s=0.2, done_at=2.5)
    assert buf.started_at == 2.5 and end == pytest.approx(2.52) and buf.underruns == 0


def test_playback_nothing_received():
    buf = PlaybackBuffer()
    assert buf.finish(3.0) == 3.0 and buf.started_at is None and buf.underruns == 0


def test_playback_rejects_bad_input():
    with pytest.raises(ValueError):
        PlaybackBuffer(prebuffer_s=-1)
    with pytest.raises(ValueError):
        PlaybackBuffer().on_audio(0.0, -5)


def test_b64_decoded_len_matches_decoding():
    for n in range(0, 12):
        s = base64.b64encode(bytes(range(n))).decode()
        assert b64_decoded_len(s) == n
    with pytest.raises(ValueError):
        b64_decoded_len("abc")


# ---- config, audio, report ----------------------------------------------------------------------------------------

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


def test_report_counts_false_starts_seen_and_withdrawn():
    c = Collector()
    c.turn(_rec(0, 0, false_starts=1, talked_over=True))
    c.turn(_rec(0, 1))
    cfg = LoadConfig(url="http://h:1", sessions=1, turns=2)
    u = load_utterance(None)
    rep = build_report(cfg, c, 1.0, {"gpu": "unknown", "source": None}, u,
                       {"withdrawn": 3.0, "confirmed": 5.0, "withdrawn_rows": 40.0})
    assert rep["false_starts"] == {"seen_by_client": 1, "talked_over_turns": 1, "withdrawn": 3, "confirmed": 5,
                                   "withdrawn_rows": 40, "per_turn": 2.0}
    assert "false starts: 2.00 per turn (1 seen by clients, 3 withdrawn unseen wasting 40 engine rows" in \
        format_table(rep)
    assert build_report(cfg, c, 1.0, {"gpu": "unknown"}, u)["false_starts"]["withdrawn"] is None


def _write_wav(path: Path, x: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.clip(x * 32767, -32768, 32767).astype("<i2").tobytes())
    return path


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


def _rec(session: int, turn: int, **kw) -> TurnRecord:
    base = dict(status="ok", ttfa_ms=100.0 + session, ttfa_commit_ms=90.0, response_status="completed",
                audio_s=1.6, deltas=4, gaps_ms=[20.0, 30.0, 40.0], rtf=0.5)
    base.update(kw)
    return TurnRecord(session=session, turn=turn, **base)


def test_report_counts_metrics_and_round_trip(tmp_path):
    a, b = Collector(), Collector()
    a.sessions_started = a.sessions_connected = a.sessions_ended = 1
    b.sessions_started = b.sessions_connected = b.sessions_ended = 1
    a.turn(_rec(0, 0))
    a.turn(_rec(0, 1, underruns=2, stall_ms=30.0))
    b.turn(_rec(1, 0, status="error", error_code="response_failed", response_status="failed"))
    b.turn(_rec(1, 1, status="cut", ttfa_ms=None, ttfa_commit_ms=None, audio_s=0.0, gaps_ms=[]))
    b.error("response_failed", "boom")
    merged = Collector()
    merged.merge(a)
    merged.merge(Collector.from_dict(json.loads(json.dumps(b.to_dict()))))
    cfg = LoadConfig(url="http://h:1", sessions=2, turns=2)
    u = load_utterance(None)
    rep = build_report(cfg, merged, 12.0, {"gpu": "unknown", "source": None}, u)
    json.dumps(rep)  # serialisable
    assert rep["turns"] == {"planned": 4, "recorded": 4, "ok": 2, "error": 1, "timeout": 0, "cut": 1}
    assert rep["sessions"] == {"planned": 2, "started": 2, "connected": 2, "ended": 2}
    assert rep["errors"]["by_code"] == {"response_failed": 1} and rep["errors"]["total"] == 1
    assert rep["underruns"] == {"total": 2, "turns_with_underruns": 1, "turns": 3}
    assert set(rep["metrics"]) == set(METRICS)
    assert rep["metrics"]["ttfa_ms"]["count"] == 3  # the cut turn has none
    assert rep["metrics"]["gap_ms"]["count"] == 9
    assert [(r["session"], r["turn"]) for r in rep["turn_records"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    table = format_table(rep)
    assert "ttfa_ms" in table and "underruns: 2 in 1 of 3 turns" in table and "response_failed=1" in table


def test_capacity_row_says_when_the_budget_is_inside_the_p95_interval():
    rep = _level_report(120, 207.0)
    rep["metrics"]["ttfa_commit_ms"]["p95_ci"] = [188.0, 231.0]
    row = capacity._row(120, rep, "ttfa_commit_ms", ["p95 ttfa_commit_ms 207 ms > 200 ms"], 200.0)
    assert "188-231" in row and "OVER" in row and "inside the p95's 90% interval" in row
    rep["metrics"]["ttfa_commit_ms"]["p95_ci"] = [150.0, 190.0]
    row = capacity._row(120, rep, "ttfa_commit_ms", [], 200.0)
    assert "150-190" in row and row.endswith("ok")
    del rep["metrics"]["ttfa_commit_ms"]["p95_ci"]  # too few turns for an interval
    assert capacity._row(4, rep, "ttfa_commit_ms", [], 200.0).endswith("ok")


def test_capacity_levels_and_verdict():
    assert capacity.levels(4, 4, 16) == [4, 8, 12, 16]
    with pytest.raises(ValueError):
        capacity.levels(0, 1, 4)
    ok = {"metrics": {"ttfa_commit_ms": {"p95": 150.0}}, "underruns": {"total": 0, "turns_with_underruns": 0},
          "errors": {"total": 0, "by_code": {}}, "turns": {"ok": 8, "planned": 8, "timeout": 0, "cut": 0}}
    assert capacity.verdict(ok, "ttfa_commit_ms", 200.0) == []
    slow = json.loads(json.dumps(ok))
    slow["metrics"]["ttfa_commit_ms"]["p95"] = 250.0
    slow["underruns"] = {"total": 3, "turns_with_underruns": 2}
    why = capacity.verdict(slow, "ttfa_commit_ms", 200.0)
    assert len(why) == 2 and "250 ms > 200 ms" in why[0] and "3 underruns" in why[1]
    # server_vad: a server whose loop fell behind ends turns late; TTFA from the commit cannot show it.
    late = json.loads(json.dumps(ok))
    late["metrics"]["vad_delay_ms"] = {"p95": 857.0}
    assert capacity.verdict(late, "ttfa_commit_ms", 200.0) == []  # no VAD criterion asked for (commit mode)
    why = capacity.verdict(late, "ttfa_commit_ms", 200.0, vad_silence_ms=300, vad_lag_budget_ms=200)
    assert len(why) == 1 and "behind real time" in why[0] and "857 ms > 300 ms" in why[0]
    late["metrics"]["vad_delay_ms"]["p95"] = 425.0  # the VAD's own ~100-150 ms: within
    assert capacity.verdict(late, "ttfa_commit_ms", 200.0, vad_silence_ms=300, vad_lag_budget_ms=200) == []


def _level_report(n: int, p95: float) -> dict:
    """What run_level returns, as far as `bench capacity` reads it."""
    m = {"p50": p95 - 20, "p95": p95, "p99": p95 + 10}
    felt = {k: v + 200 for k, v in m.items()}  # speech end -> first audio: the VAD's wait on top
    return {"metrics": {"ttfa_commit_ms": m, "ttfa_ms": felt}, "turns": {"ok": 2 * n, "planned": 2 * n, "timeout": 0,
                                                                       "cut": 0},
            "underruns": {"total": 0, "turns_with_underruns": 0, "turns": 2 * n}, "errors": {"total": 0, "by_code": {}},
            "wall_s": 1.0, "client_lag_ms": {}, "config": {}, "audio": {}, "sessions": {"planned": n},
            "false_starts": {"per_turn": 0.25}, "turn_records": [{"ttfa_commit_ms": p95}]}


def test_capacity_refine_halves_the_gap_to_the_first_failing_level(monkeypatch, tmp_path, capsys):
    """--refine: after a coarse sweep (4 passes, 20 fails), levels halfway between the capacity and the first failing
    level above it; a server whose p95 is 100 + 10 ms per session passes up to 10 sessions."""
    from moss_speech.cli import main

    ran = []

    def level(cfg, utt, hw, progress):
        ran.append(cfg.sessions)
        return _level_report(cfg.sessions, 100.0 + 10.0 * cfg.sessions)

    monkeypatch.setattr(capacity, "prepare", lambda args, n, d: (None, types.SimpleNamespace(duration_s=2.0),
                                                                 {"gpu": "test"}))
    monkeypatch.setattr(capacity, "run_level", level)
    out = tmp_path / "cap.json"
    assert main(["bench", "capacity", "--url", "http://127.0.0.1:9", "--start", "4", "--step", "16", "--max", "36",
                 "--no-warmup", "--refine", "5", "--quiet", "--json", str(out)]) == 0
    assert ran == [4, 20, 12, 8, 10, 11]  # 4 ok, 20 over; then 12 over, 8 ok, 10 ok, 11 over: no level left between
    d = json.loads(out.read_text())
    assert d["capacity"] == 10 and d["capacity_is_lower_bound"] is False
    assert [p["sessions"] for p in d["curve"]] == [4, 8, 10, 11, 12, 20]
    # Judged on speech end -> first audio too (p95 300 + 10 ms per session, budget 400): capacity 10 as well.
    assert d["capacity_speech_end"] == 10 and d["speech_end_budget_ms"] == 400
    out_text = capsys.readouterr().out
    assert "capacity: 10 concurrent sessions" in out_text
    assert "capacity by speech end -> first audio (p95 <= 400 ms): 10 concurrent sessions" in out_text
    assert "false starts 0.25/turn" in out_text
    # The lowest level failing: halfway down to 1.
    assert capacity.next_refinement([{"sessions": 8, "within": False}]) == 4
    assert capacity.next_refinement([{"sessions": 1, "within": False}]) is None
    assert capacity.next_refinement([{"sessions": 8, "within": True}]) is None  # nothing failed
    assert main(["bench", "capacity", "--url", "http://127.0.0.1:9", "--refine", "-1"]) == 2


def test_capacity_refuses_a_negative_vad_lag_budget(capsys):
    from moss_speech.cli import main

    assert main(["bench", "capacity", "--url", "http://127.0.0.1:9", "--vad-lag-budget-ms", "-5"]) == 2
    assert "--vad-lag-budget-ms must be >= 0" in capsys.readouterr().err


def test_plots_are_written(tmp_path):
    from moss_speech.loadtest import plots

    recs = [{"start_s": float(i), "ttfa_ms": 100.0 + 10 * i, "underruns": i % 2} for i in range(6)]
    p1 = plots.ttfa_cdf({"4 sessions": [100, 120, 180], "8 sessions": [150, 220]}, tmp_path / "c.png", "t")
    p2 = plots.timeline(recs, tmp_path / "t.png", "t")
    pt = lambda n, p95, u: {"sessions": n, "metrics": {"ttfa_ms": {"p50": p95 / 2, "p95": p95, "p99": p95 * 1.1}},
                            "underruns": {"turns_with_underruns": u, "turns": 8}}
    wide = pt(4, 260, 3)
    wide["metrics"]["ttfa_ms"]["p95_ci"] = [240.0, 290.0]  # drawn as an error bar; the others have none
    p3 = plots.capacity_curve([pt(1, 80, 0), pt(2, 120, 0), wide], tmp_path / "k.png", "t", "ttfa_ms")
    for p in (p1, p2, p3):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


# ---- the client against the real server code, scripted engine (fast, deterministic answers) --------------------

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


# ---- CI smoke: the real server with the tiny model, driven by the CLI -----------------------------------------------

@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moss_speech.cli", "serve", "--model", "tiny-random",
                                 "--codec", "tiny-random", "--device", "cpu", "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moss-speech serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"moss-speech serve not healthy in 240 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_smoke_loadtest_cli_against_tiny_model(tiny_server, tmp_path):
    out = tmp_path / "report.json"
    plots = tmp_path / "plots"
    res = subprocess.run([sys.executable, "-m", "moss_speech.cli", "loadtest", "--url", tiny_server,
                          "--sessions", "3", "--turns", "2", "--max-output-tokens", "25", "--think-ms", "100",
                          # The tiny model on a busy 2-core CI machine answers slowly (TTFA of seconds): generous
                          # bounds, so that only a real failure fails.
                          "--turn-timeout", "120", "--duration", "200",
                          "--json", str(out), "--plots", str(plots), "--quiet"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(out.read_text())
    assert rep["errors"] == {"total": 0, "by_code": {}, "samples": {}}
    assert rep["sessions"] == {"planned": 3, "started": 3, "connected": 3, "ended": 3}
    assert rep["turns"] == {"planned": 6, "recorded": 6, "ok": 6, "error": 0, "timeout": 0, "cut": 0}
    assert Counter(r["session"] for r in rep["turn_records"]) == {0: 2, 1: 2, 2: 2}
    fields = set(TurnRecord.__dataclass_fields__) - {"gaps_ms"}
    for r in rep["turn_records"]:
        assert set(r) == fields
        assert r["ttfa_ms"] > 0 and r["audio_s"] > 0 and r["deltas"] >= 1
        assert r["response_status"] in ("completed", "incomplete")  # incomplete: cut at --max-output-tokens
    for name in METRICS:
        assert set(rep["metrics"][name]) == {"count", "mean", "p50", "p95", "p99", "max", "p95_ci"}
    assert rep["metrics"]["ttfa_ms"]["count"] == 6
    assert rep["hardware"]["gpu"]  # a name or "unknown"
    assert "ttfa_ms" in res.stdout and "errors: 0" in res.stdout
    assert (plots / "ttfa_cdf.png").is_file() and (plots / "ttfa_timeline.png").is_file()


def test_bench_sessions_reports_the_server_cost_of_real_time_sessions(tmp_path, capsys):
    """In-process sessions with server_vad at real time: every frame delivered, every user's turn detected."""
    from moss_speech.cli import main

    out = tmp_path / "sessions.json"
    assert main(["bench", "sessions", "--sessions", "3", "--seconds", "4", "--json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["sessions"] == 3 and run["frames"] == 3 * 200  # 4 s of 20 ms frames each
    assert run["turns_detected"] >= 3  # a 4 s window holds the end of each user's 2.3 s utterance
    assert run["cpu_s"] > 0 and run["cpu_ms_per_session_s"] > 0 and run["late_ms"]["p50"] >= 0
    assert "sessions    3:" in capsys.readouterr().out
