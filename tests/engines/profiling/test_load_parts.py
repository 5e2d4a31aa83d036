"""engines/profiling/load_parts.py reads back what the engine's load log writes (Spans.describe) and sums it over a
run."""

from __future__ import annotations

import gzip

import pytest

from engines.process.observe.spans import Spans
from engines.profiling import load_parts


def _window(spans: dict[str, list[float]]) -> str:
    s = Spans()
    for name, seconds in spans.items():
        for x in seconds:
            s.add(name, x)
    return f"2026-11-29 11:26:41,314 INFO engine[1] engines.process: load parts: {Spans.describe(s.take())}"


def test_a_runs_parts_are_summed_from_the_engines_own_lines(tmp_path, capsys):
    first = "codec round (first chunks)"
    windows = [{"encode": [0.030, 0.040], "encode commits": [0.010], first: [0.020, 0.030, 0.025]},
               {"encode commits": [0.012, 0.014], first: [0.060]}]
    log = tmp_path / "server-A-1.log.gz"
    with gzip.open(log, "wt") as f:
        f.write("INFO engine: load: 12 loop steps\n" + "\n".join(_window(w) for w in windows) + "\n")
    parts = load_parts.read(log)
    # each window's mean is rounded to 0.1 ms by the log line: totals within 0.05 ms a call
    assert parts["encode"][0] == 2 and parts["encode"][1] == pytest.approx(70.0, abs=0.1) and parts["encode"][2] == 40
    assert parts["encode commits"][0] == 3 and parts["encode commits"][1] == pytest.approx(36.0, abs=0.15)
    assert parts[first] == (4, pytest.approx(135.0, abs=0.2), 60.0)
    other = tmp_path / "server-B-2.log"
    other.write_text(_window({"encode": [0.050]}) + "\n")
    load_parts.main([str(log), str(other), "--parts", "encode,encode commits"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["part", "server-A-1", "server-B-2"]
    assert out[1].split() == ["encode", "2x", "35.0", "(40)", "1x", "50.0", "(50)"]
    assert out[2].split() == ["encode", "commits", "3x", "12.0", "(14)", "-"]
