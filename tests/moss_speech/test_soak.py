"""The soak benchmark's arithmetic (the run itself is `moss-speech bench soak`, not part of the test suite)."""

from __future__ import annotations

import pytest

from moss_speech.loadtest.soak import Run, Sample, Turn, slope_per_hour, summary


def test_slope_is_per_hour_and_needs_three_points():
    assert slope_per_hour([(0.0, 100.0), (1800.0, 101.0), (3600.0, 102.0)]) == pytest.approx(2.0)
    assert slope_per_hour([(0.0, 5.0), (10.0, 5.0), (20.0, 5.0)]) == 0.0
    assert slope_per_hour([(0.0, 1.0), (1.0, 2.0)]) is None


def test_summary_fits_after_the_warm_up_and_compares_first_and_last_windows():
    run = Run()
    # 1 MB in the warm-up tenth, then flat: no slope.
    run.samples = [Sample(t, 100.0 if t < 60 else 101.0, 800.0, 0, 0, 0.0) for t in range(0, 600, 5)]
    run.turns = [Turn(t, "talk", 100.0 if t < 60 else 300.0, "completed") for t in range(0, 600, 2)]
    s = summary(run, 600.0, 60.0, kv_after=0)
    assert s["server_rss_mb"]["slope_per_hour"] == 0.0 and s["engine_rss_mb"]["slope_per_hour"] == 0.0
    assert s["ttfa_p95_ms"]["first_window"] == pytest.approx(100.0)
    assert s["ttfa_p95_ms"]["last_window"] == pytest.approx(300.0)
    assert s["kv_used"]["after_all_closed"] == 0 and s["underruns"] == 0.0
    assert s["turns_by_kind"] == {"talk": 300, "barge": 0, "drop": 0}
