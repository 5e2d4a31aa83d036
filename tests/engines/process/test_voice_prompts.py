"""Voice prompts as a hostile client sends them: bounded from the WAV header before any work, made off the engine
loop (other sessions keep stepping while one is in the making), the session's own answer waiting for it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from engines.audio.wav import write_wav
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from engines.speech_out.voice import Voice
from tests.engines.process import service_loop
from tests.engines.process.fake_service import FakeDecoder, FakeEncoder, greedy, of, run, send

WAIT_S = 60.0  # bound on waiting for the voice thread: a hang fails the test instead of blocking it


class RecordingDecoder(FakeDecoder):
    """The fake decoder, recording the voice each answer's stream was opened with."""

    def __init__(self) -> None:
        super().__init__()
        self.voices: dict[str, object] = {}

    def open_stream(self, session_id: str, voice=None, seed: int = 0):
        self.voices[session_id] = voice
        return super().open_stream(session_id, voice, seed)


def service(load) -> Service:
    ec = EngineConfig(kv_cache_bytes=8 * 1024 * 1024, max_model_len=2048)
    return Service(Engine.from_name("tiny-random", ec, seed=0), StandInTokenizer(), FakeEncoder(), RecordingDecoder(),
                   load)


def gated(made: Voice) -> tuple[threading.Event, Callable[[bytes], Voice]]:
    """A prompt loader held until the gate is set (the prompt stays in the making), then giving `made`."""
    gate = threading.Event()

    def load(wav: bytes) -> Voice:
        assert gate.wait(WAIT_S)
        return made

    return gate, load


def wav_bytes(tmp_path, seconds: float, rate: int) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    path = tmp_path / f"v{rate}.wav"
    write_wav(path, (0.2 * np.sin(2 * np.pi * 3 * t)).astype(np.float32), rate)
    return path.read_bytes()


@pytest.mark.parametrize(("rate", "seconds"), [(400, 975.0), (250, 1500.0), (250_000, 1.0), (8_000, 31.0)])
def test_a_prompt_out_of_bounds_is_refused_from_its_header(tmp_path, rate: int, seconds: float) -> None:
    """A header claiming 400 Hz makes 780 KB "975 s" long: refused before any of it is decoded or encoded, with
    invalid_audio; a refused update changes nothing and the session goes on."""
    loaded: list[bytes] = []
    svc = service(lambda wav: loaded.append(wav))
    wav = wav_bytes(tmp_path, seconds, rate)
    assert len(wav) < 1 << 20
    out = send(svc, m.OpenSession("a", voice_wav=wav))
    assert [(type(x), x.code) for x in out] == [(m.Error, "invalid_audio")] and "a" not in svc.sessions
    assert "voice_wav" in out[0].message
    send(svc, m.OpenSession("b"))
    out = send(svc, m.UpdateSession("b", instructions="Be brief.", voice_wav=wav))
    assert [(type(x), x.code) for x in out] == [(m.Error, "invalid_audio")]
    assert svc.sessions["b"].instructions is None and not svc.sessions["b"].voice_waiting
    assert not loaded and not svc._voices.busy()
    send(svc, m.AddUserText("b", "i", "hello"))
    send(svc, m.CreateResponse("b", "r", "text", greedy(3, 3)))
    assert [d.status for d in of(run(svc), m.ResponseDone)] == ["incomplete"]  # (max_output_tokens)


def test_a_prompt_is_made_off_the_loop_while_other_sessions_step(tmp_path) -> None:
    """While a prompt's encoding is held on a gate, another session's answer runs to its end (its steps and audio);
    the prompt's own session's answer waits for it, then speaks in it."""
    started, gate = threading.Event(), threading.Event()
    made = Voice.random(seed=3, n_codes=4)

    def load(wav: bytes) -> Voice:
        started.set()
        assert gate.wait(WAIT_S)
        return made

    svc = service(load)
    send(svc, m.OpenSession("a"))
    send(svc, m.OpenSession("b"))
    assert send(svc, m.UpdateSession("a", voice_wav=wav_bytes(tmp_path, 2.0, 16000))) == [m.SessionReady("a")]
    assert started.wait(WAIT_S)  # in the making, on the voice worker's thread
    for sid in ("a", "b"):
        send(svc, m.AddUserText(sid, "i", "hello"))
        out = send(svc, m.CreateResponse(sid, "r" + sid, "audio", greedy(6, 6)))
        assert [type(x) for x in out] == ([] if sid == "a" else [m.ResponseStarted])
    steps0 = svc.engine.stats().steps
    msgs = []
    while svc.engine.has_work() or svc._codec.busy():
        msgs += [x for _, x in service_loop.step(svc)]
    assert not gate.is_set() and svc._voices.busy()
    assert svc.engine.stats().steps - steps0 >= 6
    assert [(d.response_id, d.status, d.audio_samples) for d in of(msgs, m.ResponseDone)] == [
        ("rb", "incomplete", 6 * 1920)]
    assert not [x for x in msgs if getattr(x, "session_id", None) == "a"]
    assert svc.sessions["a"].voice is None and "a" not in svc.decoder.voices
    gate.set()
    msgs = run(svc)
    assert [(d.response_id, d.status) for d in of(msgs, m.ResponseDone)] == [("ra", "incomplete")]
    assert not of(msgs, m.Error)
    assert svc.decoder.voices == {"a": made, "b": None} and svc.sessions["a"].voice is made


def test_a_recording_that_cannot_be_used_is_refused_and_the_answer_goes_on(tmp_path) -> None:
    def load(wav: bytes) -> Voice:
        raise ValueError("voice_wav is not a usable recording: too short")

    svc = service(load)
    send(svc, m.OpenSession("a"))
    send(svc, m.UpdateSession("a", voice_wav=wav_bytes(tmp_path, 0.5, 16000)))
    send(svc, m.AddUserText("a", "i", "hello"))
    send(svc, m.CreateResponse("a", "r", "audio", greedy(3, 3)))
    msgs = run(svc)
    assert [(x.code, "usable" in x.message) for x in of(msgs, m.Error)] == [("invalid_audio", True)]
    assert [d.status for d in of(msgs, m.ResponseDone)] == ["incomplete"]
    assert svc.sessions["a"].voice is None and svc.sessions["a"].voice_wav is None


def test_only_the_latest_prompt_counts_and_a_closed_session_gets_none(tmp_path) -> None:
    gate = threading.Event()
    voices = iter([Voice.random(seed=1, n_codes=2), Voice.random(seed=2, n_codes=3), Voice.random(seed=4)])

    def load(wav: bytes) -> Voice:
        assert gate.wait(WAIT_S)
        return next(voices)

    svc = service(load)
    send(svc, m.OpenSession("a"))
    send(svc, m.OpenSession("c"))
    first, second = wav_bytes(tmp_path, 1.0, 16000), wav_bytes(tmp_path, 1.5, 22050)
    send(svc, m.UpdateSession("a", voice_wav=first))
    send(svc, m.UpdateSession("a", voice_wav=second))
    send(svc, m.UpdateSession("c", voice_wav=first))
    send(svc, m.CloseSession("c"))
    gate.set()
    assert not of(run(svc), m.Error)
    a = svc.sessions["a"]
    assert a.voice_wav == second and not a.voice_waiting and a.voice.name.startswith("random-")
    assert "c" not in svc.sessions and not svc._voices.busy()


def test_the_default_voice_comes_back_and_a_prompt_in_the_making_no_longer_counts(tmp_path) -> None:
    made = Voice.random(seed=5, n_codes=2)
    gate, load = gated(made)
    svc = service(load)
    send(svc, m.OpenSession("a"))
    gate.set()
    send(svc, m.UpdateSession("a", voice_wav=wav_bytes(tmp_path, 1.0, 16000)))
    send(svc, m.AddUserText("a", "i", "hello"))
    send(svc, m.CreateResponse("a", "r1", "audio", greedy(3, 3)))
    run(svc)
    assert svc.decoder.voices == {"a": made}
    assert send(svc, m.UpdateSession("a", default_voice=True)) == [m.SessionReady("a")]
    send(svc, m.AddUserText("a", "j", "hello"))
    send(svc, m.CreateResponse("a", "r2", "audio", greedy(3, 3)))
    assert [d.status for d in of(run(svc), m.ResponseDone)] == ["incomplete"]
    assert svc.decoder.voices == {"a": None} and svc.sessions["a"].voice_wav is None

    gate.clear()  # a prompt in the making, the answer waiting for it: the default voice's answer goes ahead
    send(svc, m.UpdateSession("a", voice_wav=wav_bytes(tmp_path, 1.0, 16000)))
    send(svc, m.AddUserText("a", "k", "hello"))
    assert send(svc, m.CreateResponse("a", "r3", "audio", greedy(3, 3))) == []
    out = send(svc, m.UpdateSession("a", default_voice=True))
    assert of(out, m.ResponseStarted) and of(out, m.SessionReady)
    gate.set()
    assert [d.response_id for d in of(run(svc), m.ResponseDone)] == ["r3"]
    assert svc.decoder.voices == {"a": None} and svc.sessions["a"].voice is None


def test_an_answer_waiting_for_its_voice_stopped_by_its_listener_is_dropped_without_an_error(tmp_path) -> None:
    """A listener's stop (output_audio_buffer.clear) is a cancel and then a cut where the listener is: an answer still
    waiting for its voice prompt ends at the cancel, and the cut finds nothing to cut (no error: the client did
    nothing wrong); the session's next answer speaks in the voice."""
    made = Voice.random(seed=5, n_codes=2)
    gate, load = gated(made)
    svc = service(load)
    send(svc, m.OpenSession("a"))
    send(svc, m.UpdateSession("a", voice_wav=wav_bytes(tmp_path, 1.0, 16000)))
    send(svc, m.AddUserText("a", "i", "hello"))
    assert send(svc, m.CreateResponse("a", "r1", "audio", greedy(3, 3))) == []  # waits for the voice
    stopped = send(svc, m.CancelResponse("a", "r1")) + send(svc, m.TruncateResponse("a", "r1", 0))
    assert not of(stopped, m.Error)
    assert [(d.response_id, d.status) for d in of(stopped, m.ResponseDone)] == [("r1", "cancelled")]
    gate.set()
    send(svc, m.AddUserText("a", "j", "hello"))
    send(svc, m.CreateResponse("a", "r2", "audio", greedy(3, 3)))
    msgs = run(svc)
    assert not of(msgs, m.Error)
    assert [d.response_id for d in of(msgs, m.ResponseDone)] == ["r2"]
    assert svc.decoder.voices == {"a": made}
