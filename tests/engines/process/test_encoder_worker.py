"""The engine service's speech encoder worker (engines/process/encoder_worker.py): the same codes on its thread as
inline and as one stream alone, commits with the whole-segment floor, re-encodes on their own slots; and with the
thread, the engine loop steps while an encoder call is still running (its faults: test_encoder_worker_faults.py)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from engines.audio.wav import float32_to_pcm16, read_wav
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.encoder_worker import EncoderWorker
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.profiling.log_mel_codes import _encoder
from engines.protocol import messages as m
from engines.speech_in import ENCODER_PRESETS, SpeechEncoder
from tests.engines.process import service_loop
from tests.engines.process.encoder_worker_checks import (
    BrokenEncoder,
    assembled,
    check_committed_codes_are_the_whole_segment_ones_and_the_commit_comes_last,
    wait_until_idle,
)
from tests.engines.process.service_loop import WAIT_S
from tests.engines.speech_in.encoder_helpers import StepGate, speech_en, speech_like, whole_segment_codes
from tests.paths import DATA


@pytest.mark.parametrize("threaded", [False, True])
def test_committed_codes_are_the_whole_segment_ones_and_the_commit_comes_last(enc, threaded):
    check_committed_codes_are_the_whole_segment_ones_and_the_commit_comes_last(enc, threaded)


def test_the_load_log_gets_each_kind_of_call_with_its_cpu_and_gpu_wait(enc):
    worker = EncoderWorker(enc)
    worker.append("a", speech_like(0.5, seed=1))
    worker.append("b", speech_like(0.5, seed=2))
    assert worker.run_due(flush=True)  # held audio of both in one call
    worker.append("a", speech_like(0.2, seed=3))
    assert worker.commit("a") and worker.run_due()
    spans = worker.take_spans()
    names = ("encode", "encode cpu", "encode gpu wait", "encode commits", "encode commits cpu",
             "encode commits gpu wait", "encode refloor")  # (a's start is quiet: the commit encodes it again)
    assert set(spans) == set(names)
    assert spans["encode refloor"][1] <= spans["encode commits"][1]  # part of the commit's call
    assert all(spans[k][0] == 1 for k in names)  # (count, seconds, max): one call of each kind
    assert all(0 <= spans[k + " gpu wait"][1] <= spans[k][1] for k in ("encode", "encode commits"))
    assert worker.take_spans() == {}


@pytest.mark.parametrize("threaded", [False, True])
def test_a_commit_carries_its_turns_codes_with_the_whole_segment_floor(enc, threaded):
    """A tentative commit's result carries the codes so far as the floor of the audio so far makes them, the final
    commit's those of the whole turn (its stream went on after the tentative one)."""
    pcm = read_wav(DATA / "speech_en_16k.wav")[0][:24000].astype(np.float32)  # its first ~0.4 s are quiet
    worker = EncoderWorker(enc, threaded=threaded)
    worker.append("a", pcm[:16500])
    assert worker.commit("a", final=False)
    (e,) = wait_until_idle(worker)
    so_far = enc.refloor(pcm[:16500], final=False)
    assert e.commit and e.refloor == so_far and so_far is not None
    codes = e.codes[: so_far.first] + so_far.codes
    worker.append("a", pcm[16500:])
    assert worker.commit("a")
    results = wait_until_idle(worker)
    worker.close()
    assert [r.commit for r in results][-1] and all(r.refloor is None for r in results[:-1])
    codes += [c for r in results for c in r.codes]
    r = results[-1].refloor
    assert codes[: r.first] + r.codes == whole_segment_codes(enc, pcm) != enc.encode(pcm)
    assert enc.runner.kv.in_use == 0


def test_turns_committed_together_are_encoded_again_in_one_call_on_their_own_slots(enc, monkeypatch):
    """Three quiet-start turns committed at once: one re-encode for the three (on a busy server a re-encode each
    would add up in every answer's wait), each with the codes it has re-encoded alone, and the re-encode's streams on
    the slots the finalized turns gave back (a full pool has none to spare)."""
    pcm = read_wav(DATA / "speech_en_16k.wav")[0].astype(np.float32)  # its first ~0.4 s are quiet
    turns = {"a": pcm[:20000], "b": pcm[:24000], "c": pcm[:30000]}
    worker = EncoderWorker(enc)
    for key, x in turns.items():
        worker.append(key, x)
    assert worker.run_due(flush=True)
    peak = []
    opened = enc.open_stream

    def open_stream(reencode=False):
        s = opened(reencode)
        peak.append(enc.runner.kv.in_use)
        return s

    monkeypatch.setattr(enc, "open_stream", open_stream)
    for key in turns:
        assert worker.commit(key)
    results = wait_until_idle(worker)
    assert worker.take_spans()["encode refloor"][0] == 1  # (count, seconds, max)
    alone = {key: enc.refloor(x, final=True) for key, x in turns.items()}
    assert {e.key: e.refloor for e in results if e.commit} == alone and None not in alone.values()
    assert peak and max(peak) <= len(turns)
    assert enc.runner.kv.in_use == 0


def test_a_turn_whose_floor_rose_is_encoded_again_while_spoken_so_its_commit_has_nothing_to_redo(enc, monkeypatch):
    """A turn's running max rises while the user speaks (a quiet start, then louder words): once no other call is
    due, its stream is rewound to its segment's start with the max so far as its floor and goes on from there (a
    result with that re-encode and no new codes). Its commit, after no further rise, encodes nothing again; its
    codes, the re-encodes applied, are the whole-segment ones."""
    pcm = speech_en(2.25)  # its max rises up to 1.9 s
    worker = EncoderWorker(enc)
    results = []
    for i in range(0, pcm.size, 1280):
        worker.append("a", pcm[i:i + 1280])
        assert worker.run_due(flush=True)  # its held audio
        worker.run_due()  # a rewind, if its max rose
        results += worker.take_results()
    rewinds = [e for e in results if e.refloor is not None]
    assert rewinds and all(e.codes == [] and not e.commit for e in rewinds)
    assert worker.take_spans()["encode rewind"][0] >= len(rewinds)
    assert len(rewinds) < pcm.size // 1280 / 2  # only where it rose
    opened = []
    monkeypatch.setattr(enc, "open_stream", lambda reencode=False: opened.append(reencode))
    assert worker.commit("a")
    last = wait_until_idle(worker)
    monkeypatch.undo()
    assert [e.commit for e in last] == [True] and last[0].refloor is None and opened == []
    assert assembled(results + last) == {"a": whole_segment_codes(enc, pcm)}
    assert enc.runner.kv.in_use == 0


def full_pool(enc: SpeechEncoder, monkeypatch) -> None:
    """Every slot in use stays so: the pool cannot grow."""
    from engines.speech_in.slot_pool import PoolFullError

    def full(capacity):
        raise PoolFullError("all the speech encoder's KV slots are in use")

    monkeypatch.setattr(enc.runner.kv, "_grow", full)


@pytest.mark.parametrize("reencodes", [1, 0])
def test_on_a_full_server_segments_passed_together_are_re_encoded_one_after_another(reencodes, monkeypatch, caplog):
    """Every speaker's slot in use and no memory to grow; two speaking turns pass a segment's end in one call. With
    one slot held back for re-encodes, their segments are encoded again one after another in it, each with the codes
    it has alone; with none, the turns keep the running floor's codes there, with a warning line."""
    cfg = dataclasses.replace(ENCODER_PRESETS["tiny-random"], max_source_positions=52)  # 1.04 s segments
    enc = _encoder(cfg, seed=1)
    enc.reserve(2, reencodes=reencodes)
    full_pool(enc, monkeypatch)
    pcm = read_wav(DATA / "speech_en_16k.wav")[0].astype(np.float32)  # its first ~0.4 s are quiet
    turns = {"a": pcm[:20000], "b": pcm[:24000]}
    worker = EncoderWorker(enc)
    for key, x in turns.items():
        worker.append(key, x)
    with caplog.at_level("WARNING", logger="engines.process"):
        assert worker.run_due(flush=True)
        results = worker.take_results()
    floors = {e.key: e.refloor for e in results}
    warned = [r for r in caplog.records if "keeps the running floor" in r.getMessage()]
    if reencodes:
        assert floors == {key: enc.refloor(x, False, 0, 1) for key, x in turns.items()} and not warned
        assert None not in floors.values()
    else:
        assert floors == {"a": None, "b": None} and len(warned) == 2
        assert all(r.levelname == "WARNING" and r.exc_info is None for r in warned)
    for key in turns:
        assert worker.commit(key)
    wait_until_idle(worker)
    worker.close()
    assert enc.runner.kv.in_use == 0


def test_on_a_full_server_turns_answered_early_are_re_encoded_in_their_own_streams(monkeypatch):
    """Every slot in use, none held back, no memory to grow: two turns committed tentatively in one call are
    encoded again by rewinding their own streams, each with the codes it has alone, and go on from there."""
    enc = SpeechEncoder.load("tiny-random")
    enc.reserve(2)
    pcm = read_wav(DATA / "speech_en_16k.wav")[0].astype(np.float32)
    turns = {"a": pcm[:20000], "b": pcm[:24000]}
    alone = {key: enc.refloor(x, final=False) for key, x in turns.items()}
    full_pool(enc, monkeypatch)
    worker = EncoderWorker(enc)
    for key, x in turns.items():
        worker.append(key, x)
        assert worker.commit(key, final=False)
    results = wait_until_idle(worker)
    assert {e.key: e.refloor for e in results if e.commit} == alone and None not in alone.values()
    for key in turns:
        worker.append(key, pcm[turns[key].size:turns[key].size + 8000])
        assert worker.commit(key)
    results = wait_until_idle(worker)
    assert all(not isinstance(e.codes, Exception) for e in results)
    worker.close()
    assert enc.runner.kv.in_use == 0


def _engine() -> Engine:
    return Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)


def test_service_on_the_thread_gives_the_same_conversation(enc):
    """Two sessions speak, commit and are answered: with the encoder's calls on their thread the conversations,
    messages and codes are those of the inline service."""
    greedy = m.Sampling(greedy=True, max_new_tokens=6, min_new_tokens=6)

    def run(threaded: bool):
        svc = Service(_engine(), StandInTokenizer(), enc, None, encode_every_s=0.08, encoder_thread=threaded)
        out = []
        for sid in "ab":
            out += svc.handle(b"c", m.OpenSession(sid, sampling=greedy))
        speech = {sid: speech_like(1.2, seed=i) for i, sid in enumerate("ab")}
        for i in range(0, 19200, 640):
            for sid, pcm in speech.items():
                out += svc.handle(b"c", m.AppendUserAudio(sid, float32_to_pcm16(pcm[i:i + 640])))
            out += svc.step()
        out += svc.handle_many([(b"c", msg) for sid in "ab" for msg in (
            m.CommitUserAudio(sid, "i"), m.CreateResponse(sid, "r", "text", greedy))])
        out += service_loop.until_idle(svc)
        svc._speech.close()
        hist = [svc.engine.conversation_history(sid) for sid in "ab"]
        final = {(type(x).__name__, x.session_id, getattr(x, "status", None)) for _, x in out
                 if not isinstance(x, m.UserAudioProgress)}
        return hist, final

    inline = run(False)
    threaded = run(True)
    assert threaded[0] == inline[0] and threaded[0][0] != threaded[0][1]
    assert threaded[1] == inline[1] and ("ResponseDone", "a", "incomplete") in inline[1]  # (max tokens)
    assert not any(k[0] == "Error" for k in inline[1])


def test_service_steps_while_a_commit_is_encoding(enc):
    """With the thread, a commit's encoder call does not hold the engine loop: another session's answer keeps
    stepping, and the committing session's CreateResponse waits for its last codes, then runs."""
    gate = threading.Event()

    class GatedStream:  # every call waits for the gate
        def __init__(self) -> None:
            self.stream = enc.open_stream()

        def push(self, pcm):
            assert gate.wait(WAIT_S), "the test never opened the gate"
            return self.stream.push(pcm)

        def finalize(self, last=None):
            assert gate.wait(WAIT_S), "the test never opened the gate"
            return self.stream.finalize(last)

        def close(self) -> None:
            self.stream.close()

    class GatedEncoder:
        def open_stream(self):
            return GatedStream()

    svc = Service(_engine(), StandInTokenizer(), GatedEncoder(), None, encoder_thread=True)
    greedy = m.Sampling(greedy=True, max_new_tokens=40, min_new_tokens=40)
    for sid in "ab":
        svc.handle(b"c", m.OpenSession(sid, sampling=greedy))
    svc.handle(b"c", m.AddUserText("b", "i", "hello"))
    svc.handle(b"c", m.CreateResponse("b", "rb", "text", greedy))
    svc.handle(b"c", m.AppendUserAudio("a", float32_to_pcm16(speech_like(0.5, seed=4))))
    out = svc.handle_many([(b"c", m.CommitUserAudio("a", "i")), (b"c", m.CreateResponse("a", "ra", "text", greedy))])
    assert not any(isinstance(x, m.ResponseStarted) for _, x in out)  # a's answer waits for its commit
    assert svc.sessions["a"].commit_pending is not None and len(svc.sessions["a"].after_commit) == 1
    steps_before = svc.engine.stats().steps
    for _ in range(5):
        out += svc.step()
    assert svc.engine.stats().steps >= steps_before + 5  # b's answer stepped meanwhile
    assert not any(isinstance(x, m.ResponseStarted) and x.session_id == "a" for _, x in out)
    gate.set()
    out += service_loop.until_idle(svc)
    svc._speech.close()
    done = {x.session_id: x.status for _, x in out if isinstance(x, m.ResponseDone)}
    assert done == {"a": "incomplete", "b": "incomplete"}  # (max tokens)
    assert not any(isinstance(x, m.Error) for _, x in out)
    assert svc.sessions["a"].commit_pending is None and svc.sessions["a"].after_commit == []


def test_no_kv_slot_for_another_speaker_is_server_busy_for_that_session(enc):
    """The speech encoder's pool full and unable to grow (PoolFullError): that session's turn fails with server_busy
    and the reason; once a slot is back, its next turn is encoded."""
    from engines.speech_in.slot_pool import PoolFullError

    class FullEncoder:
        full = True

        def open_stream(self):
            if self.full:
                raise PoolFullError("too many streams speaking at once: all 2 of the speech encoder's KV slots ...")
            return enc.open_stream()

    full = FullEncoder()
    svc = Service(_engine(), StandInTokenizer(), full, None)
    svc.handle(b"c", m.OpenSession("a"))
    out = svc.handle(b"c", m.AppendUserAudio("a", float32_to_pcm16(speech_like(0.3, seed=5))))
    errors = [(x.code, x.message) for _, x in out if isinstance(x, m.Error)]
    assert len(errors) == 1 and errors[0][0] == "server_busy"
    assert "speech encoder failed: PoolFullError: too many streams speaking at once" in errors[0][1]
    full.full = False
    out = svc.handle_many([(b"c", m.AppendUserAudio("a", float32_to_pcm16(speech_like(0.5, seed=6)))),
                           (b"c", m.CommitUserAudio("a", "i"))])
    assert not any(isinstance(x, m.Error) for _, x in out)
    svc.handle(b"c", m.CloseSession("a"))
    while svc.has_work():
        svc.step()
    assert enc.runner.kv.in_use == 0


def test_service_reports_an_encoder_failure_and_keeps_the_session(enc):
    """A call that fails: the sessions in it get an engine_error and their turns are dropped; the next turn of the
    same session is encoded and answered."""
    svc = Service(_engine(), StandInTokenizer(), BrokenEncoder(enc), None)
    greedy = m.Sampling(greedy=True, max_new_tokens=4, min_new_tokens=4)
    svc.handle(b"c", m.OpenSession("a", sampling=greedy))
    svc.handle(b"c", m.OpenSession("b", sampling=greedy))
    ones = float32_to_pcm16(np.ones(3200))
    out = svc.handle_many([(b"c", m.AppendUserAudio("a", ones)),
                           (b"c", m.AppendUserAudio("b", float32_to_pcm16(speech_like(0.3, seed=5))))])
    errors = sorted((x.session_id, x.code) for _, x in out if isinstance(x, m.Error))
    assert errors == [("a", "engine_error"), ("b", "engine_error")]
    assert all("speech encoder failed" in x.message for _, x in out if isinstance(x, m.Error))
    out = svc.handle(b"c", m.CommitUserAudio("a", "i"))  # nothing left of the failed turn
    assert [(type(x).__name__, x.code) for _, x in out] == [("Error", "invalid_request")]
    out = svc.handle_many([(b"c", m.AppendUserAudio("a", float32_to_pcm16(speech_like(0.5, seed=6)))),
                           (b"c", m.CommitUserAudio("a", "i")), (b"c", m.CreateResponse("a", "r", "text", greedy))])
    while svc.has_work():
        out += svc.step()
    assert [x.status for _, x in out if isinstance(x, m.ResponseDone)] == ["incomplete"]  # (max tokens)
    # Two commits in one call, one of them at full scale: both fail with the encoder's error and their turns (already
    # partly in the engine) are dropped; each session's next message runs as usual.
    speech = float32_to_pcm16(speech_like(0.5, seed=7))
    svc.handle_many([(b"c", m.AppendUserAudio("a", speech)), (b"c", m.AppendUserAudio("b", speech))])
    assert svc.sessions["a"].active is not None and svc.sessions["a"].active.audio_open  # prefilling a's turn
    out = svc.handle_many([(b"c", m.AppendUserAudio("a", ones)), (b"c", m.CommitUserAudio("a", "i")),
                           (b"c", m.CommitUserAudio("b", "i")), (b"c", m.AddUserText("a", "i2", "hi")),
                           (b"c", m.CreateResponse("a", "r2", "text", greedy))])
    assert sorted((x.session_id, x.code) for _, x in out if isinstance(x, m.Error)) == [("a", "engine_error"),
                                                                                      ("b", "engine_error")]
    while svc.has_work():
        out += svc.step()
    assert [(x.response_id, x.status) for _, x in out if isinstance(x, m.ResponseDone)] == [("r2", "incomplete")]
    for sid in "ab":
        svc.handle(b"c", m.CloseSession(sid))
    while svc.has_work():
        svc.step()
    st = svc.engine.stats()
    assert st.free_blocks == st.total_blocks and enc.runner.kv.in_use == 0


def test_user_audio_and_commits_during_a_step_go_to_the_encoder_the_rest_after_it(enc):
    """Service.handle_early (messages that arrive while the engine waits for a step): user audio and commits reach the
    encoder's thread at once; anything touching the engine, a commit with nothing to finalize, a message of another
    client's or an unknown session, and every later message of a session with one put off, wait, in order. Handling
    them so gives the same conversations as handling them all after the step."""
    greedy = m.Sampling(greedy=True, max_new_tokens=12, min_new_tokens=12)
    speech = {sid: float32_to_pcm16(speech_like(0.6, seed=i)) for i, sid in enumerate("ab")}

    def service(threaded: bool) -> Service:
        svc = Service(_engine(), StandInTokenizer(), enc, None, encoder_thread=threaded)
        for sid in "abc":
            svc.handle(b"c", m.OpenSession(sid, sampling=greedy))
        svc.handle(b"x", m.OpenSession("x", sampling=greedy))
        return svc

    svc = service(True)
    items = [(b"c", m.AppendUserAudio("a", speech["a"])), (b"c", m.CommitUserAudio("a", "i")),
             (b"c", m.AppendUserAudio("a", speech["b"])),  # after a's commit: waits for it, as in handle_many
             (b"c", m.CreateResponse("a", "ra", "audio", greedy)),  # the engine's: after the step
             (b"c", m.AppendUserAudio("a", speech["b"])),  # behind the one put off
             (b"c", m.AppendUserAudio("x", speech["b"])),  # another client's session
             (b"c", m.CommitUserAudio("c", "i")),  # nothing to finalize: the engine ends the turn
             (b"c", m.AppendUserAudio("c", speech["a"])), (b"c", m.Ping(1)),
             (b"c", m.AppendUserAudio("b", speech["b"]))]
    later = svc.handle_early(items)
    assert later == items[3:9]
    assert svc.sessions["a"].commit_pending is not None and len(svc.sessions["a"].after_commit) == 1
    assert svc._speech.holding("b") or svc._speech.busy()
    svc._speech.close()
    assert service(False).handle_early(items) == items  # without the encoder's thread: all after the step

    def converse(early: bool) -> tuple[list, list]:
        svc = service(True)
        turns = [[(b"c", m.AppendUserAudio(sid, speech[sid])), (b"c", m.CommitUserAudio(sid, "i")),
                  (b"c", m.CreateResponse(sid, "r" + sid, "audio", greedy))] for sid in "ab"]
        out = []
        for turn in turns:
            out += svc.handle_many(svc.handle_early(turn) if early else turn)
            for _ in range(3):
                out += svc.step()
        out += service_loop.until_idle(svc)
        svc._speech.close()
        done = sorted((x.session_id, x.status, x.output_rows) for _, x in out if isinstance(x, m.ResponseDone))
        return [svc.engine.conversation_history(sid) for sid in "ab"], done

    early = converse(True)
    assert early == converse(False)
    assert [sid for sid, _, rows in early[1]] == ["a", "b"] and early[1][0][2] == 12 and early[0][0] != early[0][1]


def test_a_commit_during_a_held_call_waits_for_it(enc, monkeypatch):
    """A session's commit that arrives while a call of other sessions' held audio is in flight is encoded after that
    call (one call at a time on the worker's thread). Codes equal each session alone."""
    enc.reserve(8)  # (a commit's new stream must not wait for a growth of the pool, which waits for the held call)
    gate = StepGate(monkeypatch, enc)
    worker = EncoderWorker(enc, every_s=0.0, threaded=True)
    pcms = {k: speech_like(0.6, seed=40 + i) for i, k in enumerate("abc")}
    worker.append("a", pcms["a"])
    worker.append("b", pcms["b"])
    assert gate.inside.wait(WAIT_S)  # a call of held audio waits in the encoder
    worker.append("c", pcms["c"])
    assert worker.commit("c")
    assert worker.take_results() == []
    gate.gate.set()
    for k in "ab":
        assert worker.commit(k)
    results = wait_until_idle(worker)
    worker.close()
    # The held call's results (a's and b's audio so far) come out first; c's commit started once it had ended.
    held = [e for e in results if e.key in "ab" and not e.commit]
    (c,) = [e for e in results if e.key == "c"]
    assert len(held) == 2 and results[:2] == held and c.commit and c.started >= max(e.at for e in held)
    assert assembled(results) == {k: whole_segment_codes(enc, p) for k, p in pcms.items()}
    assert enc.runner.kv.in_use == 0
