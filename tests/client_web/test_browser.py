"""The web page in headless Chromium: a fake microphone speaks a WAV, the page hears the answer over WebRTC.

Runs the real server (app factory, uvicorn, engine process) on loopback and Debian's `chromium` through
Playwright (never `playwright install`). A screenshot of the page after the turn is saved under
artifacts/ for a human to look at. Chromium is required: CI installs it (`make test`); without it these
tests fail with a message saying how to install it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from engines.audio.wav import write_wav
from server.audio.pcm import read_wav
from server.settings import Settings
from tests.fakes.harness import RunningServer, fake_settings
from tests.paths import REPO
from tests.server.transports.webrtc_support import SPEECH_WAV

ARTIFACTS = REPO / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LEVEL_THRESHOLD = 0.003  # client_web/app.js LEVEL_THRESHOLD


def _chromium_args(fake_mic: Path | None) -> list[str]:
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--autoplay-policy=no-user-gesture-required",
            "--use-fake-device-for-media-stream"]
    if fake_mic is not None:
        args += ["--use-fake-ui-for-media-stream", f"--use-file-for-fake-audio-capture={fake_mic}"]
    return args


@pytest.fixture(scope="module")
def playwright():
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is required for the browser tests: apt-get install -y chromium "
                    "(or run `make test`, which installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def fake_mic(tmp_path_factory) -> Path:
    """The speech WAV at 48 kHz with long silence after it, so the looping fake mic makes one turn per loop."""
    x, _ = read_wav(SPEECH_WAV, target_rate=48000)
    pcm = np.concatenate([np.zeros(24000, np.float32), x, np.zeros(48000 * 6, np.float32)])
    path = tmp_path_factory.mktemp("mic") / "speech_48k.wav"
    write_wav(path, pcm, 48000)
    return path


@pytest.fixture(scope="module")
def fake_server():
    with RunningServer(fake_settings()) as srv:
        srv.wait_engine()
        yield srv


@pytest.fixture(scope="module", params=["fake-engine", "tiny-random"])
def server(request):
    """The scripted engine process (fast, deterministic words), then the real engine with the tiny random model."""
    if request.param == "fake-engine":
        settings = fake_settings()
    else:
        settings = Settings(model="tiny-random", codec="tiny-random", device="cpu", engine_ready_timeout_s=120)
    with RunningServer(settings) as srv:
        srv.wait_engine(timeout=120)
        srv.engine_kind = request.param
        yield srv


def _stats(page) -> dict:
    return page.evaluate("() => JSON.parse(JSON.stringify(window.__mossStats))")


def _wait(page, js: str, timeout_s: float, what: str) -> None:
    try:
        page.wait_for_function(js, timeout=timeout_s * 1000)
    except Exception as e:  # noqa: BLE001 - add what the page saw to the failure
        raise AssertionError(f"page: {what} not reached in {timeout_s} s; stats={_stats(page)}; "
                             f"error banner={page.inner_text('#error')!r}") from e


@pytest.mark.timeout(120)
def test_page_talks_over_webrtc_and_shows_ttfa(playwright, server, fake_mic):
    ARTIFACTS.mkdir(exist_ok=True)
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=_chromium_args(fake_mic))
    try:
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        console: list[str] = []
        page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
        page.goto(server.http + "/")
        _wait(page, "() => window.__mossStats && window.__mossStats.infoLoaded", 10, "server info loaded")
        assert page.is_visible("#random-notice"), "the random-weights notice must show for tiny-random"
        assert page.is_enabled("#eagerness") and page.is_disabled("#vad-silence")  # semantic VAD's own setting

        page.click("#connect")
        _wait(page, "() => window.__mossStats.connected", 20, "call connected")
        calls = server.app.state.calls
        assert len(calls) == 1
        _wait(page, "() => window.__mossStats.ttfaMs.length >= 1", 40, "a turn with a measured TTFA")
        (session,) = server.app.state.sessions.sessions.values()
        td = session.config.turn_detection  # the page's default: the end-of-turn model, the soonest to answer
        assert (td.type, td.eagerness) == ("semantic_vad", "auto"), td
        if server.engine_kind == "fake-engine":
            _wait(page, "() => window.__mossStats.events['response.done'] >= 1", 20, "response.done")
        # (random weights rarely sample end-of-speech: that answer runs to max_output_tokens, so we do not wait)
        _wait(page, f"() => window.__mossStats.maxOutLevel > {LEVEL_THRESHOLD}", 40, "the answer heard")
        stats = _stats(page)
        ttfa_text = page.inner_text("#ttfa-last")
        shot = ARTIFACTS / f"browser_call_{server.engine_kind}.png"
        page.screenshot(path=str(shot), full_page=True)

        assert stats["events"].get("input_audio_buffer.speech_started", 0) >= 1
        assert stats["events"].get("input_audio_buffer.speech_stopped", 0) >= 1
        assert stats["maxOutLevel"] > LEVEL_THRESHOLD, "the page never heard the answer"
        assert stats["ttfaMs"][0] > 0
        assert ttfa_text.endswith(" ms") and ttfa_text[:-3].isdigit(), ttfa_text
        # From the mic's level falling to silence: the silence that confirms the turn (300 ms) comes on top.
        felt, felt_text = stats["feltMs"][0], page.inner_text("#felt-last")
        assert felt is not None and felt > stats["ttfaMs"][0] + 300, (felt, stats["ttfaMs"][0])
        assert felt_text.endswith(" ms") and felt_text[:-3].isdigit(), felt_text
        assert page.evaluate("() => { const c = document.getElementById('ttfa-chart'); const d = c.getContext('2d')"
                             ".getImageData(0, 0, c.width, c.height).data; return d.some((v, i) => i % 4 == 3 && v); }"
                             ), "the chart of the last turns is empty"
        if server.engine_kind == "fake-engine":
            assert stats["serverTtfaMs"], "response.done carried no server-side ttfa_ms"
        transcript = page.inner_text("#transcript")
        assert "(spoken turn)" in transcript, transcript
        if server.engine_kind == "fake-engine":
            assert "w0" in transcript, transcript  # the scripted engine's words
        assert not stats["errors"], stats["errors"]
        print(f"\nbrowser TTFA (speech_stopped -> answer audible in the page, {server.engine_kind}): "
              f"{stats['ttfaMs'][0]:.0f} ms; from the mic's silence: {felt:.0f} ms; "
              f"server-side: {stats['serverTtfaMs'][:1]} ms; screenshot: {shot}")

        if server.engine_kind == "fake-engine":
            # Push to talk with the mic still live: a typed turn is answered (the server clears the uncommitted mic
            # audio of the call's track when the answer is asked for; a clear from the page raced frames in flight).
            updates = stats["events"].get("session.updated", 0)
            page.select_option("#turn-detection", "none")
            assert page.is_disabled("#eagerness") and page.is_disabled("#vad-silence")
            page.fill("#instructions", "  Answer in one sentence.  ")
            page.fill("#speed", "1.25")
            page.click("#apply")
            _wait(page, f"() => window.__mossStats.events['session.updated'] > {updates}", 30, "push to talk applied")
            (session,) = server.app.state.sessions.sessions.values()
            assert (session.config.instructions, session.config.speed) == ("Answer in one sentence.", 1.25)
            # No answer in flight (the looping mic may have made a second VAD turn before the switch).
            _wait(page, "() => (window.__mossStats.events['response.done'] || 0) === "
                        "(window.__mossStats.events['response.created'] || 0)", 20, "no answer in flight")
            deadline = time.monotonic() + 30  # (a bound on a hang: the live mic keeps feeding)
            while not session.input_buffer.uncommitted_samples():  # mic audio reaches the input buffer
                assert time.monotonic() < deadline, "no mic audio in the input buffer"
                time.sleep(0.02)
            before = _stats(page)["events"]
            done, cleared = before.get("response.done", 0), before.get("input_audio_buffer.cleared", 0)
            page.fill("#text-input", "typed while the mic is live")
            page.click("#text-send")
            _wait(page, f"() => window.__mossStats.events['response.done'] > {done}", 20, "the typed turn's answer")
            after = _stats(page)
            assert not after["errors"], after["errors"]
            assert after["events"].get("input_audio_buffer.cleared", 0) > cleared, "the mic audio was not cleared"

        page.click("#hangup")
        _wait(page, "() => !window.__mossStats.connected && window.__mossStats.state === 'idle'", 30, "hung up")
        deadline = time.monotonic() + 10
        while len(calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(calls) == 0, "hang-up did not free the server's peer"
    finally:
        browser.close()


@pytest.mark.timeout(60)
def test_page_explains_denied_mic_and_unreachable_server(playwright, fake_server):
    server = fake_server
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=_chromium_args(None))
    try:
        # No fake-UI flag and no granted permission: headless Chromium denies the microphone.
        page = browser.new_page()
        page.goto(server.http + "/")
        _wait(page, "() => window.__mossStats && window.__mossStats.infoLoaded", 10, "server info loaded")
        page.click("#connect")
        _wait(page, "() => window.__mossStats.errors.length > 0", 10, "an error message")
        assert "denied" in page.inner_text("#error").lower()
        assert page.is_enabled("#connect") and len(server.app.state.calls) == 0

        # The server's API cannot be reached (network error on every /v1 request).
        page2 = browser.new_page()
        page2.route("**/v1/**", lambda route: route.abort())
        page2.goto(server.http + "/")
        _wait(page2, "() => window.__mossStats && window.__mossStats.errors.length > 0", 10, "an error message")
        assert "cannot reach the server" in page2.inner_text("#error").lower()

        # A server without the end-of-turn model: its semantic VAD is greyed out and the page picks server VAD.
        page3 = browser.new_page()
        info = httpx.get(server.http + "/v1/info", timeout=10).json() | {"turn_detection": ["server_vad"]}
        page3.route("**/v1/info", lambda route: route.fulfill(json=info))
        page3.goto(server.http + "/")
        _wait(page3, "() => window.__mossStats && window.__mossStats.infoLoaded", 10, "server info loaded")
        assert page3.input_value("#turn-detection") == "server_vad"
        assert page3.is_disabled("#turn-detection option[value=semantic_vad]")
        assert page3.is_enabled("#vad-silence") and page3.is_disabled("#eagerness")
    finally:
        browser.close()
