"""Engine service end to end: real tiny engine, real tiny codec (encoder + decoder), real socket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq

from engines.api import SamplingParams
from engines.audio.wav import read_wav, write_wav
from engines.process.loading import voice_loader
from engines.process.loop import EngineServer
from engines.process.prompt import PromptBuilder
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from engines.speech_in import SpeechEncoder
from engines.speech_out.decoder import CodecDecoder
from engines.tokens import EOSP, MODALITY_PAD
from tests.engines.process import service_loop
from tests.engines.process.tiny_engine import N_OUT, engine, question_pcm
from tests.engines.speech_in.encoder_helpers import whole_segment_codes
from tests.paths import REPO

ROOT = REPO
WAV = ROOT / "tests" / "data" / "speech_en_16k.wav"
PB = PromptBuilder(StandInTokenizer())
@pytest.fixture(scope="module")
def codec() -> tuple[SpeechEncoder, CodecDecoder]:
    return SpeechEncoder.load("tiny-random"), CodecDecoder.load("tiny-random")


def test_spoken_turn_incremental_prefill_equals_prefill_at_once(codec) -> None:
    enc, dec = codec
    svc = Service(engine(), StandInTokenizer(), enc, dec)
    greedy = m.Sampling(greedy=True, max_new_tokens=N_OUT, min_new_tokens=N_OUT)
    svc.handle(b"c", m.OpenSession("s", sampling=greedy))
    pcm = question_pcm(1.0)
    out = []
    for k, i in enumerate(range(0, len(pcm), 640)):  # 20 ms pieces, as a client sends them
        out += svc.handle_many([(b"c", m.AppendUserAudio("s", pcm[i:i + 640]))])
        if k % 10 == 9:  # the engine steps every 200 ms here (a busy loop steps far more often)
            while svc.has_work():
                out += svc.step()
    while svc.has_work():  # the engine keeps up while the turn detector waits for silence
        out += svc.step()
    before = svc.engine.stats().prefilled_rows
    codes_before = [x for _, x in out if isinstance(x, m.UserAudioProgress)][-1].codes
    out += svc.handle(b"c", m.CommitUserAudio("s", "item"))
    out += svc.handle(b"c", m.CreateResponse("s", "r", "audio", greedy))
    while svc.has_work():
        out += svc.step()
    msgs = [x for _, x in out]
    errors = [x for x in msgs if isinstance(x, m.Error)]
    assert not errors
    done = [x for x in msgs if isinstance(x, m.ResponseDone)][0]
    # Speech codes of the whole utterance with its whole-segment log-mel floor (the encoder's streaming == whole is
    # tested in its suite; the re-encode at commit in test_service_refloor.py).
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    codes = whole_segment_codes(enc, samples)
    assert [x for x in msgs if isinstance(x, m.UserAudioProgress)][-1].codes == len(codes)
    prompt = PB.system_rows(None, "audio") + PB.user_audio_turn_rows(codes) + PB.assistant_prefix_rows("audio")
    hist = svc.engine.conversation_history("s")
    assert hist[:len(prompt)] == prompt and done.prompt_rows == len(prompt)
    # What was said so far was already in the KV, with its whole-segment floor: its max rose while it was spoken (a
    # quiet start), and its rows from the first code that changed were computed again then; at end of turn only the
    # codes of the last partial 80 ms, the closing rows and the assistant prefix were left to prefill.
    assert enc.encode(samples) != codes
    tail = len(codes) - codes_before + len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    assert before > len(prompt) - tail and len(codes) - codes_before <= 1
    assert svc.engine.stats().prefilled_rows - before == tail
    # Same greedy answer as prefilling the whole turn at once on a fresh engine.
    ref = engine()
    ref.add_request("ref", prompt, SamplingParams.greedy_params(N_OUT, N_OUT))
    ref_rows = []
    while ref.has_work():
        ref_rows += [(o.text_token, o.audio_token) for o in ref.step()]
    assert hist[len(prompt):] == ref_rows and len(ref_rows) == N_OUT
    # The answer's codes went through the real codec: 1920 samples of 24 kHz PCM per code.
    chunks = [x for x in msgs if isinstance(x, m.AudioChunk)]
    assert [c.index for c in chunks] == list(range(len(chunks))) and len(chunks) >= 2
    assert all(t == MODALITY_PAD and a != EOSP for t, a in ref_rows)
    assert done.audio_samples == sum(len(c.pcm24k) // 2 for c in chunks) == N_OUT * 1920
    assert done.engine_ttfa_ms is not None and done.engine_ttfa_ms > 0


def test_encoder_batches_sessions_like_alone(codec) -> None:
    enc, _ = codec
    pcm = question_pcm(0.6)
    batched = Service(engine(), StandInTokenizer(), enc, None)
    alone = Service(engine(), StandInTokenizer(), enc, None)
    for svc in (batched, alone):
        svc.handle(b"c", m.OpenSession("a"))
        svc.handle(b"c", m.OpenSession("b"))
    for i in range(0, len(pcm), 1280):
        piece_b = pcm[i:i + 1280][::-1]  # another signal for the second session
        outs = batched.handle_many([(b"c", m.AppendUserAudio("a", pcm[i:i + 1280])),
                                    (b"c", m.AppendUserAudio("b", piece_b))])
        outs += alone.handle(b"c", m.AppendUserAudio("a", pcm[i:i + 1280]))
        outs += alone.handle(b"c", m.AppendUserAudio("b", piece_b))
        assert not [x for _, x in outs if isinstance(x, m.Error)]
    for sid in ("a", "b"):
        assert batched.sessions[sid].active.codes == alone.sessions[sid].active.codes
        assert len(batched.sessions[sid].active.codes) >= 5  # 0.6 s, less the encoder's lookahead


def _recv(sock: zmq.Socket, timeout_s: float = 60.0):
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("no message from the engine process")
    return m.decode(sock.recv())


def test_engine_process_over_zmq(tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/engine.sock"
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "engines.process.main", "--model", "tiny-random",
                             "--codec", "tiny-random", "--endpoint", endpoint, "--ready-file", str(ready),
                             "--kv-cache-gib", "0.01"], cwd=ROOT, env=env)
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
        a.send(m.encode(m.Ping(1)))  # queued until the engine binds: the first Pong means loaded
        pong = _recv(a, 120)
        assert isinstance(pong, m.Pong) and pong.nonce == 1 and pong.stats["kv_free"] == pong.stats["kv_total"]
        assert json.loads(ready.read_text())["pid"] == proc.pid
        a.send(b"\x93not a message")
        assert _recv(a).code == "invalid_request"
        a.send(m.encode(m.OpenSession("s1")))
        assert _recv(a) == m.SessionReady("s1")
        b.send(m.encode(m.AddUserText("s1", "i", "hijack")))
        err = _recv(b)
        assert isinstance(err, m.Error) and err.code == "invalid_request"
        pcm = question_pcm(0.5)
        for i in range(0, len(pcm), 640):
            a.send(m.encode(m.AppendUserAudio("s1", pcm[i:i + 640])))
        a.send(m.encode(m.CommitUserAudio("s1", "item")))
        a.send(m.encode(m.CreateResponse("s1", "r1", "text", m.Sampling(greedy=True, max_new_tokens=4))))
        got = []
        while not got or not isinstance(got[-1], m.ResponseDone):
            got.append(_recv(a))
        assert not [x for x in got if isinstance(x, m.Error)]
        assert [x for x in got if isinstance(x, m.UserAudioProgress)][-1].codes == 7  # 0.5 s at 12.5 Hz
        done = got[-1]
        assert done.response_id == "r1" and done.output_rows == 4 and done.prompt_rows > 7
        assert done.text == "".join(x.text for x in got if isinstance(x, m.TextDelta))
        assert not [x for x in got if isinstance(x, m.AudioChunk)]  # text answer: no audio
        a.send(m.encode(m.CloseSession("s1")))
        a.send(m.encode(m.Ping(2)))
        pong = _recv(a)
        assert pong.nonce == 2 and pong.stats["kv_free"] == pong.stats["kv_total"] and pong.stats["sessions"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        a.close(0)
        b.close(0)
        ctx.term()


def test_engine_process_refuses_bad_arguments(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "engines.process.main", "--model", str(tmp_path / "missing"),
                        "--codec", "none", "--endpoint", f"ipc://{tmp_path}/x.sock"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no config.json" in r.stderr and "Traceback" not in r.stderr


def test_voice_prompt_from_wav(codec, tmp_path, monkeypatch) -> None:
    enc, dec = codec
    made_on = []
    prepare = dec.voices.prepare
    monkeypatch.setattr(dec.voices, "prepare", lambda *a: made_on.append(threading.current_thread()) or prepare(*a))
    svc = Service(engine(), StandInTokenizer(), enc, dec, voice_loader(enc, "tiny-random", dec))
    pcm, rate = read_wav(WAV)
    wav = tmp_path / "voice.wav"
    write_wav(wav, pcm[:rate], rate)
    out = [x for _, x in svc.handle(b"c", m.OpenSession("bad", voice_wav=b"RIFF nonsense"))]
    assert out[0].code == "invalid_audio" and "voice_wav" in out[0].message and "bad" not in svc.sessions
    assert [x for _, x in svc.handle(b"c", m.OpenSession("s", voice_wav=wav.read_bytes()))] == [m.SessionReady("s")]
    svc.handle(b"c", m.AddUserText("s", "i", "hi"))
    svc.handle(b"c", m.CreateResponse("s", "r", "audio", m.Sampling(greedy=True, max_new_tokens=6, min_new_tokens=6)))
    msgs = [x for _, x in service_loop.until_idle(svc)]
    voice = svc.sessions["s"].voice
    assert voice.name.startswith("wav-") and voice.codes.numel() > 5 and voice.mel.shape[1] == 4 * voice.codes.numel()
    # The prompt's codes are the encoder's codes of the recording, made in pieces off the loop.
    assert voice.codes.tolist() == enc.encode(pcm[:rate])[:voice.codes.numel()]
    done = msgs[-1]
    assert isinstance(done, m.ResponseDone) and done.audio_samples == 6 * 1920
    assert not [x for x in msgs if isinstance(x, m.Error)]
    # The decoder's form of the voice (a solve per prompt chunk) was made once, by the voice worker, not the loop.
    assert len(made_on) == 1 and made_on[0] is not threading.main_thread()
    dec.check_idle_cache()  # the answer's pages are back


def test_silent_client_sessions_are_closed_and_their_kv_freed(codec) -> None:
    """A server worker that dies never sends CloseSession: after client_timeout_s of silence the engine
    closes its sessions (blocks back to the pool); a client that keeps pinging keeps its own."""
    enc, dec = codec
    now = [0.0]
    ctx = zmq.Context()
    server = EngineServer(Service(engine(), StandInTokenizer(), enc, dec), "inproc://eng", ctx,
                          client_timeout_s=30.0, clock=lambda: now[0])
    dead, alive = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (dead, alive):
            s.setsockopt(zmq.LINGER, 0)
            s.connect("inproc://eng")

        def pump() -> None:
            for _ in range(200):
                server.run_once(timeout_ms=5)
                if not server.service.has_work():
                    return

        greedy = m.Sampling(greedy=True, max_new_tokens=4, min_new_tokens=4)
        for sock, sid in ((dead, "gone"), (alive, "kept")):
            sock.send(m.encode(m.OpenSession(sid)))
            sock.send(m.encode(m.AddUserText(sid, "i", "hello there")))
            sock.send(m.encode(m.CreateResponse(sid, "r", "text", greedy)))
        pump()
        st = server.service.stats()
        assert st["sessions"] == 2 and st["kv_free"] < st["kv_total"]  # both histories hold blocks
        assert server.expire_silent_clients() == []  # nobody silent yet
        now[0] = 20.0
        alive.send(m.encode(m.Ping(1)))
        pump()
        now[0] = 31.0  # `dead` last spoke at 0 s, `alive` at 20 s
        assert server.expire_silent_clients() == ["gone"]
        pump()
        assert set(server.service.sessions) == {"kept"}
        alive.send(m.encode(m.CloseSession("kept")))
        pump()
        st = server.service.stats()
        assert st["sessions"] == 0 and st["kv_free"] == st["kv_total"]
        server.service.engine.check_integrity()
    finally:
        dead.close(0)
        alive.close(0)
        server.close()
        ctx.term()


def test_a_commit_arriving_during_a_step_reaches_the_encoder_then(codec, monkeypatch) -> None:
    """The engine process reads its socket while the GPU runs a step (EngineServer._while_stepping): a user's audio
    and commit that arrive then go to the encoder's thread at once, the CreateResponse behind them after the step,
    and the answer is the one the loop gives when it reads them only between steps. The GPU wait is simulated: the
    messages arrive in one step's wait, which the engine polls."""
    assert _commit_during_a_step(codec, monkeypatch, True) == _commit_during_a_step(codec, monkeypatch, False)


def _commit_during_a_step(codec, monkeypatch, while_stepping: bool) -> list:
    """The answer's conversation history (test above)."""
    from engines.lm.runner import PendingTokens
    enc, _ = codec
    arrive: list = []  # messages to send from inside the next step's wait
    real_get = PendingTokens.get

    def get(self, on_wait=None):
        while arrive:
            client.send(m.encode(arrive.pop(0)))
        for _ in range(5):
            if on_wait is None or not on_wait():
                break
        return real_get(self)

    monkeypatch.setattr(PendingTokens, "get", get)
    ctx = zmq.Context()
    server = EngineServer(Service(engine(), StandInTokenizer(), enc, None, encoder_thread=True), "inproc://eng", ctx)
    if not while_stepping:
        server.service.step_wait = None  # messages read between steps only
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect("inproc://eng")
    try:
        greedy = m.Sampling(greedy=True, max_new_tokens=30, min_new_tokens=30)
        for sid in ("busy", "s"):
            client.send(m.encode(m.OpenSession(sid, sampling=greedy)))
        client.send(m.encode(m.AddUserText("busy", "i", "hello there")))
        client.send(m.encode(m.CreateResponse("busy", "rb", "text", greedy)))  # keeps the engine stepping
        server.run_once(timeout_ms=50)
        arrive += [m.AppendUserAudio("s", question_pcm(1.0)), m.CommitUserAudio("s", "i"),
                   m.CreateResponse("s", "rs", "audio", greedy)]
        server.run_once(timeout_ms=0)  # one step: the messages arrive in its wait
        s = server.service.sessions["s"]
        if while_stepping:
            assert s.commit_pending is not None  # handed to the encoder during the step ...
            assert [type(x).__name__ for _, x in server._later] == ["CreateResponse"]  # ... the rest after it
        else:
            assert s.commit_pending is None and not server._later
        got = []
        for _ in range(2000):
            server.run_once(timeout_ms=5)
            while client.poll(0):
                got.append(m.decode(client.recv()))
            if sum(isinstance(x, m.ResponseDone) for x in got) == 2:
                break
        done = {x.session_id: (x.status, x.output_rows) for x in got if isinstance(x, m.ResponseDone)}
        assert done == {"busy": ("incomplete", 30), "s": ("incomplete", 30)}
        assert not [x for x in got if isinstance(x, m.Error)]
        return server.service.engine.conversation_history("s")
    finally:
        server.service._speech.close()
        client.close(0)
        server.close()
        ctx.term()
