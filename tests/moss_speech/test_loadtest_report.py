"""The load test's report and `bench capacity` without a server: metrics, false starts and the table, the capacity
verdict, row and refinement, and the plots."""

from __future__ import annotations

import json
import types

import pytest

from moss_speech.loadtest import capacity
from moss_speech.loadtest.audio import load_utterance
from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.report import METRICS, build_report, format_table
from moss_speech.loadtest.results import Collector
from tests.moss_speech.loadtest_support import _rec


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
