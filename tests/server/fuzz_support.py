"""What the fuzz tests share: the error codes a client's mistakes may draw, the turn detectors they switch between,
and the checks that a server came through (only client errors, the engine idle with every KV block free)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from tests.fakes.harness import RunningServer

# What a malformed event may be refused with (client mistakes; README "Errors").
CLIENT_CODES = {
    "invalid_json", "unknown_event", "unknown_parameter", "unsupported_parameter", "invalid_value", "invalid_audio",
    "invalid_item", "unsupported_item_type", "unsupported_content_type", "unsupported_session_type",
    "unsupported_audio_format", "unsupported_turn_detection", "input_audio_buffer_commit_empty",
    "input_audio_buffer_too_large", "input_audio_buffer_not_empty", "conversation_already_has_active_response",
    "response_cancel_not_active",
    "item_truncate_invalid_item_id", "item_truncate_invalid_content_index", "item_truncate_invalid_audio_end_ms",
    "item_delete_invalid_item_id", "item_delete_mid_turn", "item_retrieve_invalid_item_id",
}

SERVER_VAD = [None, {"type": "server_vad"}, {"type": "server_vad", "create_response": False},
              {"type": "server_vad", "interrupt_response": False}]
# semantic_vad: answers held through a pause and withdrawn when the user goes on, among the other detectors
SEMANTIC_VAD = [{"type": "semantic_vad", "eagerness": e} for e in ("low", "medium", "high", "auto")] + [
    {"type": "semantic_vad", "eagerness": "auto", "interrupt_response": False},
    {"type": "semantic_vad", "eagerness": "high", "create_response": False}, {"type": "server_vad"}, None]


def assert_only_client_errors(results: list[tuple[list[dict[str, Any]], int | None]]) -> None:
    for events, close_code in results:
        assert close_code in (None, 1000)  # closed by this client at the end, never by the server
        codes = [e["error"]["code"] for e in events if e["type"] == "error"]
        assert codes, "the session drew no error at all"
        assert set(codes) <= CLIENT_CODES, sorted(set(codes) - CLIENT_CODES)


async def assert_engine_idle(srv: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    st = await srv.wait_engine_idle(60)
    assert st["sessions"] == 0 and st["running"] == 0 and st["kv_free"] == st["kv_total"], st
    assert srv.health().json()["sessions"] == 0
    raised = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not raised, [r.getMessage() for r in raised]


async def until(pred, what: str, got, timeout: float = 120.0) -> None:
    """Poll `pred` (the server's state, or the events a reader task collects) until it holds; the timeout only
    bounds a hang (then `got()` says what there was)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}: {got()}"
        await asyncio.sleep(0.05)
