"""Secrets never reach a log line: API keys in query strings, headers and subprotocols, client secrets, uvicorn's
access lines included; checked on what a real server writes while clients present them every way they can."""

from __future__ import annotations

import logging

import httpx
import pytest
import websockets

from server.ops.logs import REDACTED, Redactor, setup_logging
from tests.fakes.harness import RunningServer, fake_settings, recv_event

KEY = "sk-live-0123456789abcdef"


async def test_keys_and_secrets_are_redacted_from_every_line(capsys):
    settings = fake_settings(api_keys=[KEY])
    with RunningServer(settings) as s:
        setup_logging("info", "kv", secrets=settings.secrets())  # after uvicorn's config set its loggers' levels
        async with websockets.connect(f"{s.ws}?api_key={KEY}&model=x") as ws:
            assert (await recv_event(ws))["type"] == "session.created"
        async with websockets.connect(s.ws, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
        async with websockets.connect(s.ws, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
        with pytest.raises(websockets.InvalidStatus):
            async with websockets.connect(f"{s.ws}?api_key=wrong-guess-987654"):
                pass
        assert httpx.get(f"{s.http}/health?api_key={KEY}", timeout=10).status_code == 200
        assert httpx.get(f"{s.http}/v1/info?client_secret=ek_abc123XYZ&x=1", timeout=10).status_code == 200
        logging.getLogger("server.test").info("request headers %s", {"authorization": f"Bearer {KEY}"})
        try:
            raise RuntimeError(f"failed with key {KEY}")
        except RuntimeError:
            logging.getLogger("server.test").exception("a failure")
    out = capsys.readouterr().err
    assert "/v1/realtime?api_key=[redacted]&model=x" in out and "[accepted]" in out  # uvicorn's lines are there
    assert "/health?api_key=[redacted]" in out and "client_secret=[redacted]&x=1" in out
    for secret in (KEY, "wrong-guess-987654", "ek_abc123XYZ"):
        assert secret not in out, [ln for ln in out.splitlines() if secret in ln]
    assert out.count(REDACTED) >= 6


@pytest.mark.parametrize("line, kept", [
    ("Authorization: Bearer abc.def", "Authorization: Bearer [redacted]"),
    ("{'authorization': 'Basic dXNlcjpwYXNz'}", "{'authorization': 'Basic [redacted]'}"),
    ("sec-websocket-protocol: realtime, openai-insecure-api-key.k1k1k1",
     "sec-websocket-protocol: realtime, openai-insecure-api-key.[redacted]"),
    ("GET /v1/info?token=t0k3n HTTP/1.1", "GET /v1/info?token=[redacted] HTTP/1.1"),
    ("secret ek_Zz-9_8 used", "secret [redacted] used"),
    ("no secret in this line, api_key is a word", "no secret in this line, api_key is a word"),
])
def test_redactor_patterns(line, kept):
    assert Redactor()(line) == kept


def test_configured_secrets_are_redacted_anywhere_but_short_ones_only_by_pattern():
    r = Redactor(["long-secret-1", "abc"])
    assert r("x long-secret-1y") == f"x {REDACTED}y"
    assert r("abc and ?api_key=abc") == f"abc and ?api_key={REDACTED}"
