"""`--gpus 2` on one host, with two real engine processes on the CPU (tiny-random): sessions spread over both,
each stays on its engine, one engine killed mid-answer ends only its own sessions, and it takes sessions again
once restarted; the load test against it has no errors."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import httpx
import pytest
import websockets

from moss_speech.cli import main
from moss_speech.loadtest.audio import load_utterance
from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.driver import run_load
from moss_speech.loadtest.report import build_report
from server.limits import CPU_MAX_SESSIONS
from server.settings import gpu_count
from tests.fakes.harness import RunningServer, recv_event, recv_until, send, tiny_settings, user_text
from tests.server.engines_support import ended_by_engine_loss, long_answer, short_answer, until_health


@pytest.fixture(scope="module")
def srv():
    with RunningServer(tiny_settings(gpus="2", drain_timeout_s=1.0, engine_ping_timeout_s=20.0)) as s:
        s.wait_engine(ready=True, timeout=300)
        yield s


def engine_of(srv: RunningServer, session_id: str) -> str:
    return srv.app.state.sessions.get(session_id).engine.name


def placed(srv: RunningServer) -> dict[str, int]:
    return {name: e["sessions_placed"] for name, e in srv.health().json()["engines"].items()}


async def test_twenty_sessions_spread_over_both_engines_and_stay(srv):
    sockets = [await websockets.connect(srv.ws, max_size=None) for _ in range(20)]
    try:
        sids = [(await recv_event(ws))["session"]["moss"]["session_id"] for ws in sockets]
        on = Counter(engine_of(srv, sid) for sid in sids)
        assert sum(on.values()) == 20 and abs(on["0"] - on["1"]) <= 2, on
        assert placed(srv) == on
        body = srv.health().json()
        assert body["engine"]["kv_total"] == sum(e["stats"]["kv_total"] for e in body["engines"].values())
        assert body["max_sessions"] == 2 * CPU_MAX_SESSIONS  # each engine's limit, summed
        metrics = httpx.get(srv.http + "/metrics", timeout=10).text
        assert f'moss_engines_sessions{{engine="0"}} {on["0"]:.1f}' in metrics
        assert 'moss_engines_up{engine="1"} 1.0' in metrics
    finally:
        for ws in sockets:
            await ws.close()
    await srv.wait_engine_idle()


async def test_engine_killed_mid_answer_ends_only_its_sessions_and_takes_sessions_again(srv):
    sockets = [await websockets.connect(srv.ws, max_size=None) for _ in range(4)]
    sids = [(await recv_event(ws))["session"]["moss"]["session_id"] for ws in sockets]
    doomed = [ws for ws, sid in zip(sockets, sids, strict=True) if engine_of(srv, sid) == "1"]
    spared = [ws for ws, sid in zip(sockets, sids, strict=True) if engine_of(srv, sid) == "0"]
    assert len(doomed) == len(spared) == 2
    for ws in doomed:
        await long_answer(ws)
    for ws in spared:
        await user_text(ws, "Hi.")
        await send(ws, "response.create", response={"max_output_tokens": 12})
    os.kill(srv.engine("1").proc.pid, signal.SIGKILL)
    for code, errors in await asyncio.gather(*(ended_by_engine_loss(ws) for ws in doomed)):
        assert code == 1011 and errors[-1] == "engine_unavailable"
    for ws in spared:
        evs = await recv_until(ws, "response.done", timeout=180)
        assert not [e for e in evs if e["type"] == "error"]
        assert evs[-1]["response"]["status"] in ("completed", "incomplete")
        await ws.close()
    body = await until_health(srv.http, lambda b: b["engines"]["1"]["alive"])  # restarted and loaded
    assert body["engines"]["1"]["restarts"] == 1 and body["engines"]["0"]["restarts"] == 0
    await srv.wait_engine_idle()  # both engines' last stats idle: placement by sessions alone
    fresh = [await websockets.connect(srv.ws, max_size=None) for _ in range(2)]
    fresh_sids = [(await recv_event(ws))["session"]["moss"]["session_id"] for ws in fresh]
    assert sorted(engine_of(srv, sid) for sid in fresh_sids) == ["0", "1"]
    for ws in fresh:
        assert (await short_answer(ws))["status"] in ("completed", "incomplete")
        await ws.close()


async def test_no_session_is_placed_on_an_engine_still_loading(srv):
    loading = srv.engine("0")
    loading.ready = False  # as while it starts or restarts
    try:
        sockets = [await websockets.connect(srv.ws, max_size=None) for _ in range(3)]
        sids = [(await recv_event(ws))["session"]["moss"]["session_id"] for ws in sockets]
        assert {engine_of(srv, sid) for sid in sids} == {"1"}
        for ws in sockets:
            await ws.close()
    finally:
        loading.ready = True
    await srv.wait_engine_idle()


def test_load_test_against_two_engines_has_no_errors(srv):
    cfg = LoadConfig(url=srv.http, sessions=4, turns=1, max_output_tokens=10, think_ms=100.0, turn_timeout_s=120.0,
                     duration_s=200.0)
    collector, wall = run_load(cfg, load_utterance(None), progress=False)
    rep = build_report(cfg, collector, wall, {"gpu": "unknown", "source": None}, load_utterance(None))
    assert rep["errors"]["total"] == 0, rep["errors"]
    assert rep["turns"]["ok"] == 4, rep["turns"]
    assert srv.health().json()["engines"]["0"]["stats"]["steps"] > 0
    assert srv.health().json()["engines"]["1"]["stats"]["steps"] > 0


def test_start_up_asks_for_a_sane_gpus_setting(monkeypatch, capsys):
    with pytest.raises(ValueError, match="leave --workers at 1"):
        tiny_settings(gpus="2", workers=2)
    with pytest.raises(ValueError, match="'all' counts GPUs"):
        tiny_settings(gpus="all")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="this host has 0 GPU"):
        tiny_settings(gpus="2", device="auto")
    assert main(["serve", "--gpus", "1", "--device", "cuda"]) == 2
    assert "MOSS_GPUS (--gpus): this host has 0 GPU(s)" in capsys.readouterr().err
    assert tiny_settings(gpus="2").engine_devices(0) == ["cpu", "cpu"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert tiny_settings(gpus="all", device="cuda").engine_devices(gpu_count()) == ["cuda:0", "cuda:1", "cuda:2"]
    assert tiny_settings(gpus="2", device="auto").engine_devices(gpu_count()) == ["cuda:0", "cuda:1"]
