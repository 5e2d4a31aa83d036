"""semantic_vad and the end-of-turn model in a Session: settings validated, when a turn ends by eagerness, a late
model answer ignored, server_vad shortened only when the server says so. The model is a stand-in whose answers the
test chooses; the shipped model itself is in tests/server/test_turn_model.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engines.protocol import messages as m
from server.session import turn_detection as td_mod
from server.session.session import Session
from server.turn_model import EndOfTurnQueue
from server.vad import VadBatcher
from tests.server.session.session_support import Link, drain, feed, settled, silence, types
from tests.server.session.turn_model_fakes import HeldModel, Model, voice24k


@pytest.fixture(scope="module")
def speech24k() -> np.ndarray:
    return voice24k()


async def new_session(model: Model | None, in_server_vad: bool = False, end_of_turn: EndOfTurnQueue | None = None
                      ) -> tuple[Session, Link]:
    """A session whose end-of-turn model is `model` (or `end_of_turn`, a queue other sessions share)."""
    link = Link()
    eot = end_of_turn or (None if model is None else EndOfTurnQueue(load=lambda: model))
    batcher = VadBatcher(end_of_turn=eot, end_of_turn_in_server_vad=in_server_vad)
    s = Session("sess_test", link, vad_factory=batcher.stream)
    await s.start()
    drain(s)
    return s, link


async def update(s: Session, turn_detection) -> dict:
    await s.handle_client_event({"type": "session.update", "event_id": "u1",
                                 "session": {"audio": {"input": {"turn_detection": turn_detection}}}})
    evs = drain(s)
    assert evs[-1]["type"] == "session.updated", evs  # a refused field is reported, the rest applies
    return evs[0]  # the first refused field's error, else session.updated


async def test_semantic_vad_settings_are_validated_and_echoed():
    s, _ = await new_session(Model(0.9))
    ev = await update(s, {"type": "semantic_vad", "eagerness": "high"})
    assert ev["type"] == "session.updated"
    assert ev["session"]["audio"]["input"]["turn_detection"] == {
        "type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": True}
    assert s.config.turn_detection.type == "semantic_vad" and s.config.turn_detection.eagerness == "high"
    for bad, code, param in [
        ({"type": "semantic_vad", "eagerness": "eager"}, "invalid_value", "eagerness"),
        ({"type": "semantic_vad", "eagerness": None}, "invalid_value", "eagerness"),
        ({"type": "semantic_vad", "silence_duration_ms": 200}, "unknown_parameter", "silence_duration_ms"),
        ({"type": "semantic_vad", "create_response": "yes"}, "invalid_value", "create_response"),
        ({"type": "turn_vad"}, "unsupported_turn_detection", "type"),
        ({"type": ["server_vad"]}, "unsupported_turn_detection", "type"),  # (not a string: no dict lookup of it)
        ({"type": {"a": 1}}, "unsupported_turn_detection", "type"),
    ]:
        ev = await update(s, bad)
        assert ev["type"] == "error" and ev["error"]["code"] == code, (bad, ev)
        assert ev["error"]["param"] == f"session.audio.input.turn_detection.{param}", ev
    assert s.config.turn_detection.eagerness == "high"  # a refused field changes nothing
    ev = await update(s, {"type": "server_vad", "silence_duration_ms": 300})
    assert ev["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"


async def test_semantic_vad_is_refused_on_a_server_without_the_model():
    s, _ = await new_session(None)
    ev = await update(s, {"type": "semantic_vad"})
    assert ev["type"] == "error" and ev["error"]["code"] == "semantic_vad_unavailable", ev
    assert s.config.turn_detection.type == "server_vad"


async def stopped_after(s: Session, speech24k: np.ndarray, pause_s: float) -> tuple[list[str], dict | None]:
    """Feeds lead silence, the speech, `pause_s` of silence; the events, and speech_stopped if it came."""
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(pause_s)]))
    await settled(s)
    evs = drain(s)
    stop = next((e for e in evs if e["type"] == "input_audio_buffer.speech_stopped"), None)
    return types(evs), stop


def speech_end_ms(speech24k: np.ndarray) -> int:
    return 500 + len(speech24k) * 1000 // 24000


async def test_a_confident_model_ends_the_turn_at_the_first_short_pause(speech24k):
    model = Model(0.9)
    s, link = await new_session(model)
    await update(s, {"type": "semantic_vad", "eagerness": "medium"})
    first_words = speech24k[:int(0.48 * 24000)]  # the sample's first clause, before its 170 ms pause
    t, stop = await stopped_after(s, first_words, 1.0)
    assert t[:4] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                     "input_audio_buffer.committed", "conversation.item.added"], t
    assert "response.created" in t and len(link.of(m.CreateResponse)) == 1
    # Asked once, PROBE_WINDOWS of VAD silence after the voice; the turn's audio it heard began with the prefix.
    assert len(model.calls) == s.turns.probes == 1
    # (the test feeds faster than real time: the audio fed while the model ran counts as waited too)
    waited = stop["audio_end_ms"] - speech_end_ms(first_words)
    assert td_mod.PROBE_WINDOWS * 32 <= waited < 1000, waited
    assert model.calls[0] >= len(first_words) * 2 // 3


@pytest.mark.parametrize("eagerness, p, longest_ms", [("high", 0.25, 2000), ("auto", 0.45, 4000)])
async def test_an_unsure_model_waits_for_the_eagerness_longest_silence(speech24k, eagerness, p, longest_ms):
    model = Model(p)  # just below the eagerness's bar
    s, _ = await new_session(model)
    await update(s, {"type": "semantic_vad", "eagerness": eagerness})
    _, stop = await stopped_after(s, speech24k, longest_ms / 1000 - 0.3)
    assert stop is None  # not yet: the model said no at every probe
    probes = s.turns.probes
    assert probes >= 3  # asked again as the pause grew (96, 288, 672 ms...)
    await feed(s, silence(0.6))
    await settled(s)
    t = types(drain(s))
    assert "input_audio_buffer.speech_stopped" in t, t
    assert s.turns.probes - probes <= 1


async def test_an_answer_that_comes_after_the_user_spoke_again_is_ignored(speech24k):
    model = Model(0.99)
    s, _ = await new_session(model)
    await update(s, {"type": "semantic_vad", "eagerness": "high"})
    held = asyncio.Event()
    original = s.turns._probe

    async def late_probe(pause, audio):  # the model's answer arrives only once the user speaks again
        await held.wait()
        await original(pause, audio)

    s.turns._probe = late_probe
    half = len(speech24k) // 2
    await feed(s, np.concatenate([silence(0.5), speech24k[:half], silence(0.2)]))
    assert s.turns.probes >= 1  # (the sample's own short pause before the cut is asked about too)
    await feed(s, speech24k[half:half + 12000])  # speaking again
    held.set()
    await settled(s)
    assert types(drain(s)) == ["input_audio_buffer.speech_started"]  # the turn goes on
    s.turns._probe = original
    _, stop = await stopped_after(s, speech24k[half + 12000:], 0.5)
    assert stop is not None


async def test_server_vad_asks_the_model_only_when_the_server_says_so(speech24k):
    for in_server_vad in (False, True):
        model = Model(0.9)
        s, _ = await new_session(model, in_server_vad=in_server_vad)
        await update(s, {"type": "server_vad", "silence_duration_ms": 1500})
        _, stop = await stopped_after(s, speech24k, 0.6)
        assert (stop is not None) == in_server_vad
        assert bool(model.calls) == in_server_vad


async def test_a_session_has_one_question_out_and_asks_the_one_due_meanwhile_when_it_returns(speech24k):
    model = HeldModel(0.1)  # unsure: every pause is asked about again as it grows
    s, _ = await new_session(model)
    await update(s, {"type": "semantic_vad", "eagerness": "auto"})
    try:
        # 1 s of silence after words without a pause of their own: questions come due at 96, 288 and 672 ms
        # while the first is still out
        await feed(s, np.concatenate([silence(0.5), speech24k[:int(0.45 * 24000)], silence(1.0)]))
        assert await asyncio.to_thread(model.started.wait, 5)
        assert s.turns.probes == 1
    finally:
        model.release.set()
    await settled(s)
    # the first question, then one more about the audio by the time it came back (not one per question due)
    assert s.turns.probes == 2 and len(model.calls) == 2, model.calls
    assert model.calls[1] > model.calls[0]


async def test_a_question_whose_pause_ended_is_withdrawn_before_the_model_runs_it(speech24k):
    model = HeldModel(0.1)
    eot = EndOfTurnQueue(load=lambda: model)
    sessions = [(await new_session(None, end_of_turn=eot))[0] for _ in range(2)]
    for s in sessions:
        await update(s, {"type": "semantic_vad", "eagerness": "auto"})
    a, b = sessions
    first_words = speech24k[:int(0.45 * 24000)]  # no pause of its own
    try:
        await feed(a, np.concatenate([silence(0.5), first_words, silence(0.25)]))
        assert await asyncio.to_thread(model.started.wait, 5)  # a's question holds the model
        await feed(b, np.concatenate([silence(0.5), first_words, silence(0.25)]))  # b's waits behind it
        assert a.turns.probes == b.turns.probes == 1
        await feed(b, first_words)  # b speaks again: its question is stale
    finally:
        model.release.set()
    for s in sessions:
        await settled(s)
    assert len(model.calls) == 1, model.calls  # a's alone: b's never ran
