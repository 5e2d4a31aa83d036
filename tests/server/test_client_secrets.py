"""Ephemeral client secrets: POST /v1/realtime/client_secrets, and the realtime endpoints taking one in place of the
API key until it expires."""

from __future__ import annotations

import time

import httpx
import pytest
import websockets
from openai.types.realtime import ClientSecretCreateResponse

from server import client_secrets
from tests.fakes.harness import RunningServer, fake_settings, recv_event
from tests.server.realtime_support import AUTH, KEY


@pytest.fixture(scope="module")
def srv():
    with RunningServer(fake_settings(api_keys=[KEY])) as s:
        yield s


def test_a_secret_is_valid_until_it_expires_and_only_under_the_keys_that_signed_it():
    value, expires_at = client_secrets.issue(["k1"], 60, now=1000.0)
    assert expires_at == 1060 and value.startswith("ek_")
    assert client_secrets.valid(["k1"], value, now=1059.0)
    assert not client_secrets.valid(["k1"], value, now=1060.0)  # expired
    assert not client_secrets.valid(["k2"], value, now=1000.0)  # the API keys changed: revoked
    forged = value[:-1] + ("0" if value[-1] != "0" else "1")
    assert not client_secrets.valid(["k1"], forged, now=1000.0)
    later = value.replace("ek_1060_", "ek_9999_")  # a longer life is not the one signed
    assert not client_secrets.valid(["k1"], later, now=1000.0)
    for junk in (None, "", "k1", "ek_", "ek_x_y_z", "ek_1_2"):
        assert not client_secrets.valid(["k1"], junk, now=0.0)


def test_the_settings_a_secret_carries_are_signed_with_it():
    settings = {"type": "realtime", "instructions": "Be kind_and brief.", "audio": {"output": {"voice": "marin"}}}
    value, _ = client_secrets.issue(["k1"], 60, now=1000.0, settings=client_secrets.encode_settings(settings))
    assert client_secrets.valid(["k1"], value, now=1001.0)
    assert client_secrets.session_settings(["k1"], value, now=1001.0) == settings
    other = client_secrets.encode_settings({"type": "realtime", "instructions": "Obey."})
    swapped = value[:value.rindex(client_secrets.encode_settings(settings))] + other
    assert not client_secrets.valid(["k1"], swapped, now=1001.0)  # other settings under the same signature
    plain, _ = client_secrets.issue(["k1"], 60, now=1000.0)
    assert client_secrets.session_settings(["k1"], plain, now=1001.0) is None
    assert client_secrets.session_settings(["k1"], value, now=1061.0) is None  # expired


async def test_issued_secret_opens_the_websocket_and_an_expired_or_unknown_one_is_401(srv):
    async with httpx.AsyncClient(base_url=srv.http) as http:
        assert (await http.post("/v1/realtime/client_secrets", json={})).status_code == 401
        r = await http.post("/v1/realtime/client_secrets", headers=AUTH,
                            json={"expires_after": {"anchor": "created_at", "seconds": 120},
                                  "session": {"type": "realtime", "model": "gpt-realtime"}})
        assert r.status_code == 200, r.text
        body = r.json()
        model = ClientSecretCreateResponse.model_validate(body, strict=True)
        assert not model.__pydantic_extra__ and not set(model.session.__pydantic_extra__) - {"moss"}
        assert abs(model.expires_at - (time.time() + 120)) < 5 and model.session.expires_at == model.expires_at
        bad = await http.post("/v1/realtime/client_secrets", headers=AUTH, json={"expires_after": {"seconds": 5}})
        assert bad.status_code == 400 and "expires_after.seconds" in bad.json()["error"]["message"]
        # The WebRTC endpoint takes it too (then refuses the missing SDP, not the key).
        call = await http.post("/v1/realtime/calls", headers={"Authorization": f"Bearer {body['value']}"})
        assert call.status_code == 415
    async with websockets.connect(srv.ws, additional_headers={"Authorization": f"Bearer {body['value']}"}) as ws:
        assert (await recv_event(ws))["type"] == "session.created"
    async with websockets.connect(srv.ws, subprotocols=["realtime", f"openai-insecure-api-key.{body['value']}"]) as ws:
        assert (await recv_event(ws))["type"] == "session.created"
    expired, _ = client_secrets.issue([KEY], 10, now=time.time() - 60)
    for secret in (expired, "ek_99999999999_abc_def"):
        with pytest.raises(websockets.InvalidStatus) as e:
            async with websockets.connect(srv.ws, additional_headers={"Authorization": f"Bearer {secret}"}):
                pass
        assert e.value.response.status_code == 401


async def test_a_secret_issued_with_session_settings_opens_a_session_that_has_them(srv):
    """OpenAI's browser examples give the session's settings when they ask for the secret: the session that opens with
    it starts with them (its first session.updated); what a session.update would refuse is refused here by name."""
    session = {"type": "realtime", "model": "gpt-realtime", "instructions": "Be brief.",
               "audio": {"output": {"voice": "marin", "speed": 1.25}}}
    async with httpx.AsyncClient(base_url=srv.http) as http:
        r = await http.post("/v1/realtime/client_secrets", headers=AUTH, json={"session": session})
        assert r.status_code == 200, r.text
        shown = ClientSecretCreateResponse.model_validate(r.json(), strict=True).session
        assert shown.instructions == "Be brief." and shown.audio.output.speed == 1.25
        refused = {"speed": {"audio": {"output": {"speed": 3.0}}},
                   "voice prompt": {"moss": {"voice_prompt": {"wav": "UklGRg=="}}},
                   "size": {"instructions": "".join(chr(0x4E00 + i % 20000) for i in range(9000))},
                   "type": {"type": "transcription", "instructions": "x"}}
        for why, settings in refused.items():
            bad = await http.post("/v1/realtime/client_secrets", headers=AUTH, json={"session": settings})
            assert bad.status_code == 400, (why, bad.text)
        assert "session.audio.output.speed" in (await http.post(
            "/v1/realtime/client_secrets", headers=AUTH, json={"session": refused["speed"]})).json()["error"]["message"]
    secret = r.json()["value"]
    async with websockets.connect(srv.ws, additional_headers={"Authorization": f"Bearer {secret}"}) as ws:
        assert (await recv_event(ws))["type"] == "session.created"
        updated = await recv_event(ws)
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["instructions"] == "Be brief."
        assert updated["session"]["audio"]["output"]["speed"] == 1.25


async def test_a_call_made_with_a_secret_that_carries_settings_starts_with_them(srv):
    from tests.server.transports.webrtc_client import Client

    async with httpx.AsyncClient(base_url=srv.http, timeout=10) as http:
        r = await http.post("/v1/realtime/client_secrets", headers=AUTH,
                            json={"session": {"type": "realtime", "instructions": "Answer in French."}})
        http.headers["Authorization"] = f"Bearer {r.json()['value']}"
        client = Client(srv.http, mic=None)
        await client.connect(http)
        try:
            _, updated = await client.wait_event("session.updated", 10)
            assert updated["session"]["instructions"] == "Answer in French."
        finally:
            await client.close()
