"""CI smoke runs of the load tools: `moss-speech loadtest` against `moss-speech serve` with the tiny model, and
`bench sessions` in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from moss_speech.loadtest.report import METRICS
from moss_speech.loadtest.results import TurnRecord
from tests.fakes.harness import free_port
from tests.paths import REPO


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


def test_loadtest_times_the_transcript_of_every_turn(tiny_server, tmp_path):
    """--transcription against the real server: MOSS-Speech transcribes each committed turn itself, and every
    turn's transcript arrives (timed from its commit) beside a spoken answer."""
    out = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "moss_speech.cli", "loadtest", "--url", tiny_server,
                          "--sessions", "2", "--turns", "2", "--max-output-tokens", "12", "--think-ms", "100",
                          "--transcription", "--turn-timeout", "120", "--duration", "200", "--json", str(out),
                          "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(out.read_text())
    assert rep["errors"]["total"] == 0, rep["errors"]
    assert rep["config"]["transcription"] is True and rep["turns"]["ok"] == 4
    assert rep["metrics"]["transcript_ms"]["count"] == 4
    assert all(r["transcript_ms"] > 0 for r in rep["turn_records"])
    assert "transcript_ms" in res.stdout


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
