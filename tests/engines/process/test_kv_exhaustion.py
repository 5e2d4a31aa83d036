"""KV exhaustion as sessions with long histories cause it (tiny pool, CPU): new work that could never get its blocks
is refused with a typed error (at once, or once the running answers could no longer free enough), nothing waits
forever, the answers running go on, and every block comes back."""

from __future__ import annotations

from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from tests.engines.process.fake_service import FakeDecoder, FakeEncoder, greedy, of, run, send

POOL_BYTES = 1 << 20  # 42 blocks of 16 rows of the tiny model


def service() -> Service:
    ec = EngineConfig(kv_cache_bytes=POOL_BYTES, max_model_len=2048)
    return Service(Engine.from_name("tiny-random", ec, seed=0), StandInTokenizer(), FakeEncoder(), FakeDecoder())


def turn(svc: Service, sid: str, rid: str, chars: int, sampling: m.Sampling) -> list:
    """A session's text turn of about `chars` rows and a text answer to it (its messages so far)."""
    if sid not in svc.sessions:
        send(svc, m.OpenSession(sid, instructions="x"))
    send(svc, m.AddUserText(sid, "i", "a" * chars))
    return send(svc, m.CreateResponse(sid, rid, "text", sampling))


def test_histories_filling_the_pool_refuse_new_work_and_nothing_hangs() -> None:
    svc = service()
    eng = svc.engine
    total = eng.stats().total_blocks
    for i in range(2):  # idle conversations whose histories hold half the pool
        turn(svc, f"h{i}", f"rh{i}", 140, greedy(4, 4))
        run(svc)
    held = total - eng.stats().free_blocks
    assert held == 22
    # A live answer: its output budget is reserved whole.
    assert [type(x) for x in turn(svc, "x", "rx", 20, greedy(60, 60))] == [m.ResponseStarted]
    # Another session's answer could be admitted only with what the live one's reservation gives back: it waits.
    out = turn(svc, "y", "ry", 200, greedy(8))
    assert [type(x) for x in out] == [m.ResponseStarted] and eng.stats().waiting == 2
    # A third needs more than could ever be free while the histories stay: refused at once.
    out = turn(svc, "z", "rz", 330, greedy(8))
    assert [(type(x), getattr(x, "code", None) or x.reason) for x in out] == [
        (m.Error, "server_busy"), (m.ResponseDone, "server_busy")]
    assert "other conversations' histories" in out[0].message
    # The live answer runs to its end. It uses its whole reservation, so the waiting one can never get its blocks: it
    # is refused with a typed error instead of waiting forever (the loop goes idle).
    msgs = run(svc)
    assert not svc.has_work()
    done = {d.response_id: d for d in of(msgs, m.ResponseDone)}
    assert (done["rx"].status, done["rx"].output_rows) == ("incomplete", 60)
    assert (done["ry"].status, done["ry"].reason) == ("failed", "server_busy")
    assert [(e.code, e.response_id) for e in of(msgs, m.Error)] == [("server_busy", "ry")]
    eng.check_integrity()
    # Once histories go, the refused turn (put back as pending) is answered.
    for i in range(2):
        send(svc, m.CloseSession(f"h{i}"))
    run(svc)
    send(svc, m.CreateResponse("y", "ry2", "text", greedy(8)))
    msgs = run(svc)
    assert [(d.response_id, d.status, d.output_rows) for d in of(msgs, m.ResponseDone)] == [("ry2", "incomplete", 8)]
    assert of(msgs, m.ResponseDone)[0].prompt_rows > 200  # the refused turn's text went in with it
    for sid in list(svc.sessions):
        send(svc, m.CloseSession(sid))
    run(svc)
    eng.check_integrity()
    assert eng.stats().free_blocks == total


def test_a_user_turn_growing_past_what_could_be_freed_is_refused_and_kept() -> None:
    """A spoken turn waiting for admission grows while the user talks; once it needs more blocks than could ever
    be free, it is refused (server_busy) and its codes kept, not left waiting with every request behind it."""
    svc = service()
    eng = svc.engine
    for i in range(2):
        turn(svc, f"h{i}", f"rh{i}", 140, greedy(4, 4))
        run(svc)
    turn(svc, "x", "rx", 20, greedy(60, 60))
    send(svc, m.OpenSession("u", instructions="x", sampling=greedy(8)))
    pcm = (b"\x10\x00" * 16000)  # 1 s of 16 kHz audio: 13 codes
    msgs = []
    for _ in range(16):
        msgs += send(svc, m.AppendUserAudio("u", pcm))
    msgs += run(svc)
    assert not svc.has_work()
    assert "server_busy" in [e.code for e in of(msgs, m.Error)]
    s = svc.sessions["u"]
    assert s.active is None and s.pending_codes
    for sid in list(svc.sessions):
        send(svc, m.CloseSession(sid))
    run(svc)
    eng.check_integrity()
    assert eng.stats().free_blocks == eng.stats().total_blocks
