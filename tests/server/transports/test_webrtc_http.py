"""The HTTP side of WebRTC calls: documented refusals of bad offers, unknown calls, call and session limits, API key
and Origin, ICE timeout, the call ending with its session, /v1/info, ICE server settings."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

import pytest

from server.transports.webrtc.config import WebRTCConfig, WebRTCConfigError, parse_ice_servers
from tests.server.transports.webrtc_client import (
    asgi_client,
    offer_sdp,
    wait_until,
)
from tests.server.transports.webrtc_support import (
    FakeSettings,
    build_app,
)


@pytest.mark.parametrize("body,ctype,status,needle", [
    (b"hello", "application/sdp", 400, "v=0"),
    (b"", "application/sdp", 400, "empty"),
    (b"v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n", "application/sdp", 400, "no audio media section"),
    (b"\xff\xfe\x00", "application/sdp", 400, "UTF-8"),
    (b"v=0\r\n", "application/json", 415, "application/sdp"),
    (b"v=0\r\n" + b"a" * (70 * 1024), "application/sdp", 413, "limit"),
])
async def test_bad_offers_get_documented_errors(engine, body, ctype, status, needle):
    app = build_app(engine)
    async with asgi_client(app) as http:
        r = await http.post("/v1/realtime/calls", content=body, headers={"Content-Type": ctype})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert len(app.state.webrtc.calls) == 0 and len(app.state.sessions) == 0


async def test_offer_without_opus_or_fingerprint_is_400(engine):
    good = await offer_sdp()
    no_opus = good.replace("opus/48000/2", "speex/48000/2")
    no_fp = "\r\n".join(line for line in good.split("\r\n") if not line.startswith("a=fingerprint"))
    app = build_app(engine)
    async with asgi_client(app) as http:
        for sdp, needle in ((no_opus, "Opus"), (no_fp, "fingerprint")):
            r = await http.post("/v1/realtime/calls", content=sdp, headers={"Content-Type": "application/sdp"})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


async def test_unknown_call_id_is_404(engine):
    app = build_app(engine)
    async with asgi_client(app) as http:
        for method, path in (("GET", "/v1/realtime/calls/rtc_nope"), ("DELETE", "/v1/realtime/calls/rtc_nope"),
                             ("POST", "/v1/realtime/calls/rtc_nope/hangup"),
                             ("POST", "/v1/realtime/calls/rtc_nope/voice")):
            r = await http.request(method, path)
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "call_not_found"


async def test_too_many_calls_is_503_until_one_hangs_up(engine):
    app = build_app(engine, FakeSettings(max_calls=1))
    async with asgi_client(app) as http:
        headers = {"Content-Type": "application/sdp"}
        first = await http.post("/v1/realtime/calls", content=await offer_sdp(), headers=headers)
        assert first.status_code == 201
        second = await http.post("/v1/realtime/calls", content=await offer_sdp(), headers=headers)
        assert second.status_code == 503
        assert second.json()["error"]["code"] == "server_busy" and second.headers["retry-after"]
        assert len(app.state.sessions) == 1  # the refused call opened no session
        call_id = first.headers["location"].rsplit("/", 1)[1]
        assert (await http.delete(f"/v1/realtime/calls/{call_id}")).status_code == 204
        third = await http.post("/v1/realtime/calls", content=await offer_sdp(), headers=headers)
        assert third.status_code == 201
        await app.state.webrtc.calls.close_all()
    assert len(app.state.sessions) == 0


async def test_session_limit_refuses_the_call_with_503(engine):
    app = build_app(engine, max_sessions=1)
    app.state.sessions.create()  # another transport holds the only session
    async with asgi_client(app) as http:
        r = await http.post("/v1/realtime/calls", content=await offer_sdp(),
                            headers={"Content-Type": "application/sdp"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
    assert len(app.state.webrtc.calls) == 0


async def test_api_key_and_origin_are_enforced(engine):
    app = build_app(engine, FakeSettings(api_keys=["k1"], allowed_origins=["https://good.example"]))
    sdp = await offer_sdp()
    async with asgi_client(app) as http:
        r = await http.post("/v1/realtime/calls", content=sdp, headers={"Content-Type": "application/sdp"})
        assert r.status_code == 401
        r = await http.post("/v1/realtime/calls", content=sdp, headers={
            "Content-Type": "application/sdp", "Authorization": "Bearer k1", "Origin": "https://evil.example"})
        assert r.status_code == 403
        r = await http.post("/v1/realtime/calls", content=sdp, headers={
            "Content-Type": "application/sdp", "Authorization": "Bearer k1", "Origin": "https://good.example"})
        assert r.status_code == 201
        await app.state.webrtc.calls.close_all()


async def test_ice_timeout_frees_the_call(engine):
    """A client that never completes ICE (it never applies the answer) is dropped after ice_timeout_s."""
    app = build_app(engine, FakeSettings(ice_timeout_s=1.0))
    async with asgi_client(app) as http:
        r = await http.post("/v1/realtime/calls", content=await offer_sdp(),
                            headers={"Content-Type": "application/sdp"})
        assert r.status_code == 201
        assert len(app.state.webrtc.calls) == 1
        await wait_until(lambda: len(app.state.webrtc.calls) == 0, 30, "ICE timeout")
        await wait_until(lambda: len(app.state.sessions) == 0, 30, "session closed")


async def test_session_end_closes_the_call(engine):
    app = build_app(engine)
    async with asgi_client(app) as http:
        r = await http.post("/v1/realtime/calls", content=await offer_sdp(),
                            headers={"Content-Type": "application/sdp"})
        call = app.state.webrtc.calls.get(r.headers["location"].rsplit("/", 1)[1])
        await call.session.close("engine_lost", 1011)
        await wait_until(lambda: call.closed, 30, "call closed")
        assert call.pc.connectionState == "closed" and len(app.state.webrtc.calls) == 0


async def test_info_reports_random_weights_and_ice_servers(engine):
    ice = [{"urls": "stun:stun.example.org:3478"},
           {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "p"}]
    app = build_app(engine, FakeSettings(ice_servers=ice))
    async with asgi_client(app) as http:
        info = (await http.get("/v1/info")).json()
        page = await http.get("/")
        named = re.findall(r'(?:src|href)="(web/[^"]+)"', page.text)  # the page's scripts and stylesheet
        files = {name: await http.get("/" + name) for name in named}
    assert info["random_weights"] is True and info["model"] == "moss-speech"
    assert info["turn_detection"] == ["server_vad", "semantic_vad"]
    assert info["ice_servers"] == [{"urls": ["stun:stun.example.org:3478"]},
                                   {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "p"}]
    assert page.status_code == 200 and "MOSS-Speech" in page.text and "web/app.js" in named
    assert all(r.status_code == 200 for r in files.values()), {n: r.status_code for n, r in files.items()}
    assert "__mossStats" in files["web/app.js"].text


async def test_info_gives_ice_servers_only_to_a_key_or_client_secret(engine):
    ice = [{"urls": "stun:stun.example.org:3478"},
           {"urls": ["turn:turn.example.org:3478"], "username": "u", "credential": "p"}]
    app = build_app(engine, FakeSettings(ice_servers=ice, api_keys=["k1"]))
    app.state.client_secret_ok = lambda secret: secret == "ek_live"
    async with asgi_client(app) as http:
        anyone = (await http.get("/v1/info")).json()
        wrong = (await http.get("/v1/info", headers={"Authorization": "Bearer k2"})).json()
        keyed = (await http.get("/v1/info", headers={"Authorization": "Bearer k1"})).json()
        secret = (await http.get("/v1/info?api_key=ek_live")).json()
        offer_with_secret = await http.post("/v1/realtime/calls", content=b"v=0", headers={
            "Authorization": "Bearer ek_live", "Content-Type": "application/sdp"})
        offer_without = await http.post("/v1/realtime/calls", content=b"v=0", headers={
            "Content-Type": "application/sdp"})
    assert anyone["api_key_required"] and anyone["ice_servers"] == [] and wrong["ice_servers"] == []
    assert keyed["ice_servers"][1]["credential"] == "p" and secret["ice_servers"] == keyed["ice_servers"]
    assert offer_with_secret.status_code == 400 and offer_without.status_code == 401  # past auth: a bad offer


async def test_turn_secret_gives_each_client_time_limited_credentials(engine):
    ice = [{"urls": "stun:stun.example.org:3478"}, {"urls": ["turn:turn.example.org:3478", "turns:t.example.org"]}]
    app = build_app(engine, FakeSettings(ice_servers=ice, turn_secret="shared-secret", turn_ttl_s=3600))
    before = int(time.time())
    async with asgi_client(app) as http:
        info = (await http.get("/v1/info")).json()
    stun, turn = info["ice_servers"]
    assert stun == {"urls": ["stun:stun.example.org:3478"]}
    expiry, user = turn["username"].split(":")
    assert user == "moss" and before + 3600 <= int(expiry) <= int(time.time()) + 3600
    # What coturn's use-auth-secret checks: base64(HMAC-SHA1(secret, username)).
    digest = hmac.new(b"shared-secret", turn["username"].encode(), hashlib.sha1).digest()
    assert turn["credential"] == base64.b64encode(digest).decode()
    own = app.state.webrtc.config.rtc_configuration().iceServers[1]  # the server's own peer gets them too
    assert own.username.endswith(":moss") and own.credential


def test_ice_server_config_is_validated():
    assert parse_ice_servers('[{"urls": "stun:a:1"}]')[0].urls == ("stun:a:1",)
    with pytest.raises(WebRTCConfigError, match="username"):
        WebRTCConfig(ice_servers=parse_ice_servers([{"urls": "turn:a:1"}]))
    with pytest.raises(WebRTCConfigError, match="time-limited"):
        WebRTCConfig(ice_servers=parse_ice_servers([{"urls": "turn:a:1", "username": "u", "credential": "p"}]),
                     turn_secret="s")
    assert WebRTCConfig(ice_servers=parse_ice_servers([{"urls": "turn:a:1"}]), turn_secret="s")
    with pytest.raises(WebRTCConfigError, match="must start with"):
        parse_ice_servers([{"urls": "http://a"}])
    with pytest.raises(WebRTCConfigError, match="JSON"):
        parse_ice_servers("[{")
    with pytest.raises(WebRTCConfigError, match="ice_timeout_s"):
        WebRTCConfig(ice_timeout_s=0)
    # An empty list stays empty: aiortc would otherwise use a public STUN server.
    assert WebRTCConfig().rtc_configuration().iceServers == []


@pytest.mark.parametrize("vad, end_of_turn_model, served", [(True, False, ["server_vad"]), (False, True, [])])
async def test_info_names_only_the_turn_detection_served(engine, vad, end_of_turn_model, served):
    app = build_app(engine, FakeSettings(vad=vad, end_of_turn_model=end_of_turn_model))
    async with asgi_client(app) as http:
        assert (await http.get("/v1/info")).json()["turn_detection"] == served
