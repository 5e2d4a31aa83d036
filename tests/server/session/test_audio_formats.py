"""A session in G.711: the formats it takes and shows, the user's audio read at 8 kHz (appended or in an item), and
answers sent in the session's or the response's format; against a real server with the scripted fake engine."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from server.audio.formats import PCM, PCMA, PCMU
from server.audio.resample import resample
from tests.fakes.harness import RunningServer, fake_settings, recv_event, recv_until, send
from tests.server.realtime_support import KEY, by_type, connect, open_session
from tests.server.strict_events import check


@pytest.fixture(scope="module")
def srv():
    with RunningServer(fake_settings(api_keys=[KEY], max_input_buffer_seconds=5.0)) as s:
        yield s


def _tone(seconds: float, rate: int) -> np.ndarray:
    return (0.2 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _b64(fmt, x: np.ndarray) -> str:
    return base64.b64encode(fmt.encode(x)).decode()


async def _formats(ws, input_format, output_format):
    await send(ws, "session.update", session={"type": "realtime", "audio": {
        "input": {"format": input_format}, "output": {"format": output_format}}})
    return check(await recv_event(ws))


async def _answer(ws, **response) -> list[dict]:
    await send(ws, "response.create", **({"response": response} if response else {}))
    evs = await recv_until(ws, "response.done")
    for e in evs:
        check(e)
    return evs


def _audio(evs: list[dict], fmt) -> np.ndarray:
    return fmt.decode(b"".join(base64.b64decode(e["delta"]) for e in by_type(evs, "response.output_audio.delta")))


async def test_a_g711_session_hears_8_khz_and_answers_in_its_output_format(srv):
    async with connect(srv.ws) as pcm_ws, connect(srv.ws) as ws:
        await open_session(pcm_ws)
        await open_session(ws)
        updated = await _formats(ws, {"type": "audio/pcmu"}, {"type": "audio/pcma"})
        assert updated.session.audio.input.format.type == "audio/pcmu"
        assert updated.session.audio.output.format.type == "audio/pcma"
        for _ in range(4):  # 1 s of mu-law in four appends
            await send(ws, "input_audio_buffer.append", audio=_b64(PCMU, _tone(0.25, 8000)))
        await send(ws, "input_audio_buffer.commit")
        await recv_until(ws, "conversation.item.done")
        evs = await _answer(ws)
        resp = evs[-1]["response"]
        # Read at its own rate: 1 s is 16,000 samples at 16 kHz, the rows of 1 s of 24 kHz PCM (12 codes, a partial
        # one closed by the commit, 4 commit rows).
        assert resp["moss"]["prefilled_rows"] == 12 + 1 + 4
        assert resp["audio"]["output"]["format"] == {"type": "audio/pcma"}
        # The same answer in PCM from a session that kept the default, resampled to 8 kHz: what the A-law carries.
        await send(pcm_ws, "input_audio_buffer.append", audio=_b64(PCM, _tone(1.0, 24000)))
        await send(pcm_ws, "input_audio_buffer.commit")
        await recv_until(pcm_ws, "conversation.item.done")
        pcm_evs = await _answer(pcm_ws)
        reference = resample(_audio(pcm_evs, PCM), 24000, 8000)
        got = _audio(evs, PCMA)
        assert resp["moss"]["audio_samples"] == pcm_evs[-1]["response"]["moss"]["audio_samples"] == 3 * got.size
        assert got.size == reference.size
        assert np.abs(got - reference).max() < 0.02  # A-law's step near the tone's 0.3 peak is 1/128


async def test_a_response_may_ask_for_its_own_format(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await send(ws, "input_audio_buffer.append", audio=_b64(PCM, _tone(0.5, 24000)))
        await send(ws, "input_audio_buffer.commit")
        await recv_until(ws, "conversation.item.done")
        evs = await _answer(ws, audio={"output": {"format": {"type": "audio/pcmu"}}})
        assert by_type(evs, "response.created")[0]["response"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
        samples = evs[-1]["response"]["moss"]["audio_samples"]
        assert _audio(evs, PCMU).size == samples // 3
        evs = await _answer(ws)  # the next one in the session's format again
        assert evs[-1]["response"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
        assert _audio(evs, PCM).size == evs[-1]["response"]["moss"]["audio_samples"]


async def test_an_audio_item_is_read_in_the_sessions_input_format(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await _formats(ws, {"type": "audio/pcma"}, {"type": "audio/pcm", "rate": 24000})
        await send(ws, "conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": _b64(PCMA, _tone(1.0, 8000))}]})
        await recv_until(ws, "conversation.item.done")
        assert (await _answer(ws))[-1]["response"]["moss"]["prefilled_rows"] == 12 + 1 + 4


async def test_the_input_buffer_limit_counts_seconds_at_any_rate(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await _formats(ws, {"type": "audio/pcmu"}, {"type": "audio/pcmu"})
        for _ in range(5):  # the 5 s limit
            await send(ws, "input_audio_buffer.append", audio=_b64(PCMU, _tone(1.0, 8000)))
        await send(ws, "input_audio_buffer.append", audio=_b64(PCMU, _tone(0.1, 8000)), event_id="over")
        err = await recv_event(ws)
        assert err["error"]["code"] == "input_audio_buffer_too_large" and err["error"]["event_id"] == "over"


@pytest.mark.parametrize(("where", "fmt", "param"), [
    ("input", {"type": "audio/opus"}, "session.audio.input.format.type"),
    ("output", {"type": "audio/pcmu", "rate": 16000}, "session.audio.output.format.rate"),
    ("output", {"type": "audio/pcm", "rate": 8000}, "session.audio.output.format.rate"),
    ("input", {"type": "audio/pcma", "bits": 8}, "session.audio.input.format")])
async def test_a_format_it_does_not_take_is_refused_by_name_and_the_old_one_stays(srv, where, fmt, param):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await send(ws, "session.update", session={"type": "realtime", "audio": {where: {"format": fmt}}})
        err = check(await recv_event(ws))
        assert err.type == "error" and err.error.code in ("unsupported_audio_format", "unknown_parameter")
        assert err.error.param.startswith(param), err
        updated = check(await recv_event(ws))
        assert getattr(updated.session.audio, where).format.type == "audio/pcm"


async def test_bytes_that_are_not_the_format_are_the_clients_error(srv):
    async with connect(srv.ws) as ws:
        await open_session(ws)
        await send(ws, "input_audio_buffer.append", audio=base64.b64encode(b"\x01\x02\x03").decode(), event_id="a")
        err = await recv_event(ws)
        assert err["error"]["code"] == "invalid_audio" and "odd number of bytes" in err["error"]["message"]
        await _formats(ws, {"type": "audio/pcmu"}, {"type": "audio/pcmu"})
        await send(ws, "input_audio_buffer.append", audio=base64.b64encode(b"\x01\x02\x03").decode())
        await send(ws, "input_audio_buffer.commit")  # three mu-law bytes are three samples: a turn
        assert (await recv_event(ws))["type"] == "input_audio_buffer.committed"
