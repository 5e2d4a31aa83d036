"""The session limit when none is set: sized from what the engine reports once ready, on a GPU; 64 elsewhere."""

from __future__ import annotations

import logging
import sys

import pytest

from server.limits import (
    CPU_MAX_SESSIONS,
    FULL_CONTEXT_SESSIONS,
    SESSION_ROWS,
    SESSIONS_PER_RUNNING,
    session_limit,
    size_from_engines,
)
from tests.fakes.fake_engine import BLOCK_ROWS, KV_TOTAL
from tests.fakes.harness import RunningServer, fake_settings

GPU = {"device": "cuda", "max_running": 128, "max_model_len": 8192, "kv_total": 40_000, "kv_block_rows": 16}
FAKE_ON_GPU = [sys.executable, "-m", "tests.fakes.fake_engine", "--model", "x", "--codec", "x", "--device", "cuda"]
FAKE_POOL_SESSIONS = KV_TOTAL * BLOCK_ROWS // SESSION_ROWS


def test_on_a_gpu_the_limit_is_twice_the_running_sequences_or_the_conversations_the_pool_holds():
    assert SESSIONS_PER_RUNNING == 2
    assert session_limit(GPU).sessions == 256  # 640,000 rows hold 312 conversations: 2 x 128 running binds
    small_pool = {**GPU, "kv_total": 4_000}  # 64,000 rows
    assert session_limit(small_pool).sessions == 64_000 // SESSION_ROWS
    short = {**small_pool, "max_model_len": 1024}  # no conversation is longer than that
    assert session_limit(short).sessions == 62
    tiny = {**GPU, "kv_total": 1}
    assert session_limit(tiny).sessions == 1
    why = session_limit(GPU).why
    assert "runs 128 sequences at once (256 sessions" in why and "holds 312 conversations" in why


def test_an_engine_with_the_full_context_decoder_is_held_to_what_that_decoder_keeps_in_real_time():
    full = {**GPU, "decoder_pages_total": 936, "decoder_pages_free": 900, "decoder_pages_kept": 28}
    assert session_limit(full).sessions == FULL_CONTEXT_SESSIONS < session_limit(GPU).sessions
    assert "full-context speech decoder keeps about" in session_limit(full).why
    small = {**full, "max_running": 8}  # the language model binds first: its figure stands
    assert session_limit(small).sessions == 16 < FULL_CONTEXT_SESSIONS


def test_a_smaller_decoder_cache_holds_fewer_sessions_each_with_the_chunks_an_answer_always_keeps():
    full = {**GPU, "decoder_pages_total": 936, "decoder_pages_kept": 28}  # the default 40 GiB (the engine's figures)
    assert session_limit(full).sessions == FULL_CONTEXT_SESSIONS <= 936 // 28  # as many as it keeps in real time
    small = {**full, "decoder_pages_total": 374}  # --decoder-cache-gib 16
    assert session_limit(small).sessions == 374 // 28 == 13
    why = session_limit(small).why
    assert "cache of 374 pages holds 13 sessions' answers of 28 chunks" in why and "--decoder-cache-gib" in why
    assert session_limit({**full, "decoder_pages_total": 5}).sessions == 1  # a cache too small still serves one
    assert session_limit({**small, "max_running": 4}).sessions == 8  # the language model binds first


def test_off_a_gpu_or_without_the_figures_the_limit_is_the_cpu_default():
    assert session_limit({**GPU, "device": "cpu"}).sessions == CPU_MAX_SESSIONS
    assert "runs on cpu" in session_limit({**GPU, "device": "cpu"}).why
    without = {k: v for k, v in GPU.items() if k != "max_running"}
    assert session_limit(without).sessions == CPU_MAX_SESSIONS  # an engine that does not say
    assert session_limit({}).sessions == CPU_MAX_SESSIONS


def test_several_engines_hold_the_sum_of_their_limits_and_one_process_says_when_that_is_too_many(caplog):
    log = logging.getLogger("server.app")
    with caplog.at_level("INFO", logger="server.app"):
        assert size_from_engines([GPU, {**GPU, "kv_total": 4_000}], 1, log) == 256 + 64_000 // SESSION_ROWS
    assert "the sum of 2 engines' (256 + 31" in caplog.text and "run on Ray Serve" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="server.app"):
        assert size_from_engines([{"device": "cpu"}] * 2, 1, log) == 2 * CPU_MAX_SESSIONS
    assert "Ray Serve" in caplog.text  # 128 sessions on one server process
    with caplog.at_level("INFO", logger="server.app"):
        assert size_from_engines([GPU], 4, log) == 256  # one engine: as before


@pytest.mark.parametrize(("settings", "limit"), [
    ({"max_running": "12"}, 24),  # the engine option, passed on, bounds the sessions (two a sequence)
    ({"max_running": "500"}, FAKE_POOL_SESSIONS),  # the fake's pool of 65,536 rows does
    ({"max_running": "12", "max_sessions": 40}, 40),  # a set limit wins
])
def test_the_server_sizes_its_limit_from_the_engine_once_ready(settings, limit, caplog):
    with caplog.at_level("INFO", logger="server.app"), \
            RunningServer(fake_settings(engine_command=FAKE_ON_GPU, vad=False, **settings)) as srv:
        health = srv.health().json()
        assert health["max_sessions"] == limit
        assert health["engine"]["argv"][-2:] == ["--max-running", settings["max_running"]]
        assert srv.app.state.sessions.slots.limit == limit
    sized = [r.getMessage() for r in caplog.records if r.getMessage().startswith("max_sessions ")]
    if "max_sessions" in settings:
        assert sized == []
    else:
        assert len(sized) == 1 and sized[0].startswith(f"max_sessions {limit}: the engine runs"), sized


def test_the_server_keeps_the_cpu_default_for_an_engine_on_the_cpu():
    with RunningServer(fake_settings(vad=False)) as srv:
        assert srv.health().json()["max_sessions"] == CPU_MAX_SESSIONS
