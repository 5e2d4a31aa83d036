"""The engine service's items: input transcription as background requests, items deleted with the history cut and
prefilled again, and conversations cut to fit the context (real tiny Engine, the codec fakes of
fake_service)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.api import QueueFullError
from engines.process.sessions import Item
from engines.process.transcripts import TRANSCRIBE_INSTRUCTION
from engines.protocol import messages as m
from engines.tokens import IM_START
from tests.engines.process.fake_service import (
    PB,
    FakeEncoderStream,
    greedy,
    make_service,
    of,
    run,
    send,
    speech,
)


def codes_of(pcm: bytes) -> list[int]:
    enc = FakeEncoderStream()
    return enc.push(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0) + enc.finalize()


def spoken_turn(svc, sid: str, item: str, pcm: bytes, transcribe: bool) -> list:
    send(svc, m.AppendUserAudio(sid, pcm))
    return send(svc, m.CommitUserAudio(sid, item, transcribe=transcribe)) + run(svc)


def test_a_committed_turn_is_transcribed_apart_from_every_conversation() -> None:
    svc = make_service()
    eng = svc.engine
    total = eng.stats().total_blocks
    send(svc, m.OpenSession("s"))
    send(svc, m.OpenSession("other"))
    send(svc, m.AddUserText("other", "o1", "Hello"))
    send(svc, m.CreateResponse("other", "ro", "text", greedy(3)))
    pcm = speech(0.2)
    out = spoken_turn(svc, "s", "u1", pcm, transcribe=True)
    done = of(out, m.TranscriptionDone)
    assert len(done) == 1 and done[0].status == "completed" and done[0].item_id == "u1"
    deltas = of(out, m.TranscriptionDelta)
    assert deltas and {d.item_id for d in deltas} == {"u1"}
    assert done[0].text == "".join(d.text for d in deltas).strip()
    codes = codes_of(pcm)
    prompt = (PB.text_turn_rows("system", TRANSCRIBE_INSTRUCTION) + PB.user_audio_turn_rows(codes)
              + PB.assistant_prefix_rows("text"))
    assert done[0].prompt_rows == len(prompt) and 0 < done[0].output_rows <= 16 + len(codes)
    # The transcription touched neither conversation: each holds its own turns only (s's turn waits for its answer).
    turn = eng.live_request(svc.sessions["s"].active.request_id)
    assert turn.rows == PB.system_rows(None, "audio") + PB.user_audio_turn_rows(codes)
    hist = eng.conversation_history("other")
    assert hist[:len(PB.system_rows(None, "text"))] == PB.system_rows(None, "text")
    assert PB.text_turn_rows("system", TRANSCRIBE_INSTRUCTION)[1:] != hist[1:len(prompt)]
    assert of(out, m.ResponseDone)[0].session_id == "other"
    eng.check_integrity()
    # Its blocks went back at its end: closing both sessions returns every block.
    send(svc, m.CloseSession("s"))
    send(svc, m.CloseSession("other"))
    run(svc)
    assert eng.stats().free_blocks == total


def test_no_transcription_unless_asked_and_a_refused_one_fails_with_its_reason(monkeypatch) -> None:
    svc = make_service()
    send(svc, m.OpenSession("s"))
    out = spoken_turn(svc, "s", "u1", speech(0.2), transcribe=False)
    assert not of(out, m.TranscriptionDelta) and not of(out, m.TranscriptionDone)
    add = svc.engine.add_request

    def busy(*a, background=False, **kw):
        if background:
            raise QueueFullError("waiting queue is full")
        return add(*a, **kw)

    send(svc, m.CreateResponse("s", "r1", "text", greedy(2)))
    run(svc)
    monkeypatch.setattr(svc.engine, "add_request", busy)
    out = spoken_turn(svc, "s", "u2", speech(0.2, seed=1), transcribe=True)
    (done,) = of(out, m.TranscriptionDone)
    assert (done.item_id, done.status, done.code) == ("u2", "failed", "server_busy") and "full" in done.reason


def test_closing_a_session_stops_its_transcription_and_frees_its_blocks() -> None:
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s"))
    send(svc, m.AppendUserAudio("s", speech(0.2)))
    send(svc, m.CommitUserAudio("s", "u1", transcribe=True))
    svc.step()
    assert svc._transcripts
    send(svc, m.CloseSession("s"))
    out = run(svc)
    assert not of(out, m.TranscriptionDone) and not svc._transcripts
    assert eng.stats().free_blocks == eng.stats().total_blocks


def text_turns(svc, sid: str, n: int, words: int = 3, start: int = 0) -> list:
    out = []
    for i in range(start, start + n):
        send(svc, m.AddUserText(sid, f"i{i}", " ".join(["word"] * words) + f" {i}"))
        out += send(svc, m.CreateResponse(sid, f"r{i}", "text", greedy(3), item_id=f"a{i}"))
        out += run(svc)
    return out


def test_deleting_an_item_cuts_the_history_there_and_prefills_the_rest_again() -> None:
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s"))
    text_turns(svc, "s", 2)
    before = eng.conversation_history("s")
    system = PB.system_rows(None, "text")
    i0 = PB.text_turn_rows("user", "word word word 0")
    assert before[len(system):len(system) + len(i0)] == i0
    assert send(svc, m.DeleteItem("s", "i0")) == [m.ItemsDropped("s", ["i0"], deleted=True)]
    assert eng.conversation_history("s") == system  # cut before the item: the rest is due again
    s = svc.sessions["s"]
    assert s.refill_rows == len(s.pending_rows) == len(before) - len(system) - len(i0) + len(
        PB.assistant_close_rows(before[-1]))
    send(svc, m.AddUserText("s", "i9", "next"))
    send(svc, m.CreateResponse("s", "r9", "text", greedy(2), item_id="a9"))
    seq = eng.live_request(svc.sessions["s"].active.request_id)
    assert seq.low_until == len(system) + s.refill_rows or seq.low_until > len(system)  # the refill is background
    run(svc)
    after = eng.conversation_history("s")
    assert after[:len(before) - len(i0)] == system + before[len(system) + len(i0):]
    assert [it.item_id for it in svc.sessions["s"].items] == ["a0", "i1", "a1", "i9", "a9"]
    eng.check_integrity()


def test_a_cut_that_crosses_the_move_of_its_answer_s_rows_keeps_the_answer_whole() -> None:
    """A client's cut of the latest answer can cross a deletion (or a cut to fit) that moved the answer's rows (the
    server sent it before it heard of the move): the answer stays whole, as after a cut at its end, and no error."""
    svc = make_service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i0", "hello"))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(12, min_new=12), item_id="a0"))
    run(svc)
    assert send(svc, m.DeleteItem("s", "i0")) == [m.ItemsDropped("s", ["i0"], deleted=True)]
    s = svc.sessions["s"]
    due = list(s.pending_rows)
    assert not of(send(svc, m.TruncateResponse("s", "r0", 2400)), m.Error)
    assert s.pending_rows == due and [it.item_id for it in s.items] == ["a0"]
    assert [e.code for e in of(send(svc, m.TruncateResponse("s", "r9", 2400)), m.Error)] == ["invalid_request"]
    svc.engine.check_integrity()


def test_an_answer_that_sampled_im_start_itself_is_still_one_item_to_cut(monkeypatch) -> None:
    """The reference stops an answer only at <|endoftext|> or <|im_end|>: a model may sample <|im_start|> inside one.
    Its items are still cut where their turns begin (it was engine_error: more turn starts than items)."""
    svc = make_service()
    runner, steps = svc.engine.runner, []
    sample = runner._sample

    def sampling_im_start(sp, hidden, audio_logits):
        got = sample(sp, hidden, audio_logits)
        steps.append(None)
        if len(steps) == 2:  # the answer's second token
            got.device_pairs[:, 0] = IM_START
        return got

    send(svc, m.OpenSession("s"))
    monkeypatch.setattr(runner, "_sample", sampling_im_start)
    text_turns(svc, "s", 1)
    monkeypatch.undo()
    s = svc.sessions["s"]
    first = svc.engine.conversation_history("s") + s.close_rows  # system, i0, a0 (with <|im_start|> inside)
    text_turns(svc, "s", 1, start=1)
    hist = svc.engine.conversation_history("s")
    assert [t for t, _ in hist].count(IM_START) == 1 + 4 + 1
    assert send(svc, m.DeleteItem("s", "i1")) == [m.ItemsDropped("s", ["i1"], deleted=True)]
    assert svc.engine.conversation_history("s") + s.close_rows == first  # cut where i1 began
    assert send(svc, m.DeleteItem("s", "a0")) == [m.ItemsDropped("s", ["a0"], deleted=True)]
    assert [it.item_id for it in s.items] == ["i0", "a1"]
    run(svc)
    svc.engine.check_integrity()


def test_deleting_is_refused_during_an_answer_and_for_unknown_items() -> None:
    svc = make_service()
    send(svc, m.OpenSession("s"))
    text_turns(svc, "s", 1)
    send(svc, m.AddUserText("s", "i5", "more"))
    send(svc, m.CreateResponse("s", "r5", "text", greedy(4)))
    (err,) = of(send(svc, m.DeleteItem("s", "i0")), m.Error)
    assert err.code == "item_delete_mid_turn" and "between turns" in err.message
    run(svc)
    (err,) = of(send(svc, m.DeleteItem("s", "nope")), m.Error)
    assert err.code == "invalid_request" and "no item" in err.message
    # Another client cannot delete this session's items.
    (err,) = of(send(svc, m.DeleteItem("s", "i0"), client=b"intruder"), m.Error)
    assert "another client" in err.message
    assert [it.item_id for it in svc.sessions["s"].items] == ["i0", "a0", "i5", "r5"]
    # A committed spoken turn waiting for its answer: its request holds the turn.
    send(svc, m.AppendUserAudio("s", speech(1.0)))
    run(svc)
    send(svc, m.CommitUserAudio("s", "u6"))
    run(svc)
    (err,) = of(send(svc, m.DeleteItem("s", "i0")), m.Error)
    assert err.code == "item_delete_mid_turn"


@pytest.mark.parametrize("ratio", [0.75, 0.5])
def test_a_conversation_past_the_context_drops_its_oldest_items_and_goes_on(ratio: float) -> None:
    """Many turns through a context of 192 rows: every answer completes, the history never exceeds the context,
    the system turn stays first, and the items dropped are the oldest."""
    svc = make_service(max_model_len=192)
    eng = svc.engine
    send(svc, m.OpenSession("s", instructions="Be brief."))
    if ratio != 0.75:
        send(svc, m.SetTruncation("s", ratio))
    system = PB.system_rows("Be brief.", "text")
    dropped: list[str] = []
    for i in range(12):
        out = text_turns(svc, "s", 1, words=12, start=i)
        assert not of(out, m.Error)
        assert of(out, m.ResponseDone)[0].status == "incomplete"  # max_output_tokens: it answered
        for d in of(out, m.ItemsDropped):
            assert not d.deleted
            dropped += d.item_ids
        hist = eng.conversation_history("s")
        assert len(hist) <= 192 and hist[:len(system)] == system
    assert dropped and dropped == [x for i in range(12) for x in (f"i{i}", f"a{i}")][:len(dropped)]
    eng.check_integrity()


def test_with_truncation_disabled_a_turn_past_the_context_is_refused() -> None:
    svc = make_service(max_model_len=192)
    send(svc, m.OpenSession("s"))
    send(svc, m.SetTruncation("s", None))
    errs = []
    for i in range(12):
        errs += of(text_turns(svc, "s", 1, words=12, start=i), m.Error)
        if errs:
            break
    assert errs and errs[0].code == "request_too_large"
    (bad,) = of(send(svc, m.SetTruncation("s", 1.5)), m.Error)
    assert bad.code == "invalid_request"


def test_an_undone_audio_turn_waiting_as_codes_is_an_empty_last_item() -> None:
    """A user audio turn whose request was undone (its codes wait to be sent again) is in the items but not in the
    rows: the history can still be cut, the waiting turn kept."""
    svc = make_service()
    send(svc, m.OpenSession("s"))
    text_turns(svc, "s", 2)
    s = svc.sessions["s"]
    s.audio_item = Item(None)
    s.items.append(s.audio_item)
    s.pending_codes = [5, 6]
    n, hist, spans = svc._turn_spans(s)
    assert spans[-1] == (len(hist), len(hist)) and spans[-2][1] == len(hist)
    svc._drop(s, [0])
    assert [it.item_id for it in s.items] == ["a0", "i1", "a1", None]
