"""What the several-engine tests (--gpus, Ray Serve) do with a session: a long answer to be cut, a short one to finish,
and waiting for what their server's /health says."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.fakes.harness import recv_event, recv_until, send, start_answer, user_text


async def long_answer(ws: Any) -> None:
    """Start an answer that runs on until cut (min_output_tokens keeps the random model from stopping early)."""
    await send(ws, "session.update", session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    await recv_until(ws, "session.updated", timeout=60)
    await start_answer(ws, "Talk a lot.", max_output_tokens=400, moss={"sampling": {"min_output_tokens": 400}})


async def short_answer(ws: Any, rows: int = 6) -> dict[str, Any]:
    """A text turn answered in a few rows; returns its response.done's response (the test asserts no error)."""
    await user_text(ws, "Hi.")
    await send(ws, "response.create", response={"max_output_tokens": rows, "output_modalities": ["text"]})
    evs = await recv_until(ws, "response.done", timeout=180)
    assert not [e for e in evs if e["type"] == "error"], evs
    return evs[-1]["response"]


async def ended_by_engine_loss(ws: Any) -> tuple[int, list[str]]:
    """Read events until the server closes the socket: its close code and the error codes it sent."""
    codes = []
    while True:
        try:
            ev = await recv_event(ws, timeout=60)
        except Exception as e:  # noqa: BLE001 - websockets.ConnectionClosed carries the code
            return getattr(getattr(e, "rcvd", None), "code", -1), codes
        if ev["type"] == "error":
            codes.append(ev["error"]["code"])


async def until_health(url: str, ok: Callable[[dict[str, Any]], bool], timeout: float = 300.0) -> dict[str, Any]:
    """Poll `url`/health until `ok(body)`; returns the body (fails with the last one after `timeout`).
    A reply that is not JSON counts as not yet: Ray Serve's proxy answers a text 404 until the application's route is
    up (the server's own 503 is JSON and saying why, so `ok` sees it)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            reply = await http.get(url + "/health")
            is_json = reply.headers.get("content-type", "").startswith("application/json")
            body = reply.json() if is_json else {"not_json": reply.status_code, "text": reply.text}
            if is_json and ok(body):
                return body
            assert time.monotonic() < deadline, f"/health never became what the test waits for: {body}"
            await asyncio.sleep(0.2)
