"""The soak benchmark's arithmetic and measures (the run: `moss-speech bench soak`, not part of the test suite)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from moss_speech.loadtest import soak
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


def test_the_server_memory_is_the_front_ends_processes_and_the_engine_apart(monkeypatch):
    kids = [(11, "python -m engines.process.main"), (12, "python -c from multiprocessing.spawn import spawn_main"),
            (13, "python -c from multiprocessing.spawn import spawn_main")]
    rss = {10: 100.0, 11: 900.0, 12: 50.0, 13: 60.0}
    monkeypatch.setattr(soak, "children", lambda pid: kids if pid == 10 else [])
    monkeypatch.setattr(soak, "rss_mb", rss.get)
    assert soak.server_and_engine_rss(10) == (210.0, 900.0)


def test_a_staggered_user_waits_its_delay_before_it_first_connects(monkeypatch):
    events = []

    class Connected(Exception):
        pass

    async def fake_sleep(seconds):
        events.append(("sleep", seconds))

    async def session(self, deadline):
        events.append(("session",))
        raise Connected

    monkeypatch.setattr(soak.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(soak.User, "_session", session)
    user = soak.User("ws://x", [], Run(), 0.0, None, 1)
    with pytest.raises(Connected):
        asyncio.run(user.churn(float("inf"), 2.5))
    assert events == [("sleep", 2.5), ("session",)]


@pytest.mark.parametrize("compression", ["deflate", None])
def test_a_user_asks_for_websocket_compression_unless_told_not_to(monkeypatch, compression):
    asked = []

    class Connected(Exception):
        pass

    async def connect(url, **kwargs):
        asked.append(kwargs.get("compression", "deflate"))  # (websockets' own default: deflate)
        raise Connected

    monkeypatch.setattr(soak.websockets, "connect", connect)
    user = soak.User("ws://x", [], Run(), 0.0, None, 1, compression)
    with pytest.raises(Connected):
        asyncio.run(user._session(float("inf")))
    assert asked == [compression]


def test_the_report_names_the_server_it_drove_and_not_options_it_did_not_use():
    p = argparse.ArgumentParser()
    soak.add_arguments(p)
    remote = soak.run_config(p.parse_args(["--url", "http://gpu:8000", "--sessions", "200"]))
    assert remote["sessions"] == 200 and not {"model", "codec", "device"} & set(remote)
    local = soak.run_config(p.parse_args([]))
    assert local["model"] == "tiny-random" and local["device"] == "cpu"
    health = {"status": "ok", "model": "full-random", "codec": "full-random", "random_weights": True,
              "engine": {"device_name": "NVIDIA H200"}}
    assert soak.served(health) == {"model": "full-random", "codec": "full-random", "random_weights": True,
                                   "device": "NVIDIA H200"}
    assert soak.served({"status": "ok"})["device"] is None
