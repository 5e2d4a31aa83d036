"""Tentative commits and withdrawn answers in the engine service (real tiny Engine, the fakes of
fake_service): a withdrawn answer leaves the history, the KV pool and the encoder's stream exactly as if
the user had never paused, without prefilling the user's audio again; a confirmed one stands."""

from __future__ import annotations

import numpy as np
import pytest

from engines.process.prompt import PromptBuilder
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from tests.engines.process.fake_service import greedy, make_service, of, run, send, speech

PB = PromptBuilder(StandInTokenizer())
FIRST, REST = speech(1.01, seed=0), speech(0.6, seed=1)  # 1.01 s: 12 codes and 800 samples short of the 13th


def speak(svc, pcm: bytes) -> None:
    for i in range(0, len(pcm), 1280):  # 40 ms pieces, the engine stepping between them
        send(svc, m.AppendUserAudio("s", pcm[i:i + 1280]))
        run(svc)


def answer(svc, rid: str) -> tuple[list, m.ResponseDone]:
    send(svc, m.CommitUserAudio("s", "item"))
    send(svc, m.CreateResponse("s", rid, "audio", greedy(10, min_new=10)))
    out = run(svc)
    return [c.pcm24k for c in of(out, m.AudioChunk)], of(out, m.ResponseDone)[0]


def without_a_false_start():
    svc = make_service()
    send(svc, m.OpenSession("s", sampling=greedy(10, min_new=10)))
    speak(svc, FIRST + REST)
    audio, done = answer(svc, "r1")
    return svc, audio, done


@pytest.mark.parametrize("steps", [2, None])  # withdrawn mid-answer, or after the answer had ended
def test_a_withdrawn_answer_leaves_the_turn_as_if_the_user_had_not_paused(steps):
    ref, ref_audio, ref_done = without_a_false_start()

    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s", sampling=greedy(10, min_new=10)))
    speak(svc, FIRST)
    free = eng.stats().free_blocks
    prefilled = eng.stats().prefilled_rows
    send(svc, m.CommitUserAudio("s", "item", tentative=True))
    assert svc._speech._turns["s"].stream.buf.size == 800  # short of a code: they wait in the stream, still open
    started = send(svc, m.CreateResponse("s", "r0", "audio", greedy(10, min_new=10)))
    assert of(started, m.ResponseStarted)
    if steps is None:
        out = run(svc)
        assert of(out, m.ResponseDone)[0].status == "incomplete"
        out = send(svc, m.WithdrawResponse("s", "r0")) + run(svc)
        assert not of(out, m.ResponseDone)  # its end was already told
    else:
        for _ in range(steps):
            svc.step()
        out = send(svc, m.WithdrawResponse("s", "r0")) + run(svc)
        (done,) = of(out, m.ResponseDone)
        assert (done.status, done.reason) == ("cancelled", "withdrawn")
        assert len(of(out, m.AudioChunk)) <= 1  # stopped within a step (a chunk already decoding may still come)
    # Back to the end of the user's audio: the same rows, the same blocks, nothing prefilled again.
    user_turn = len(PB.system_rows(None, "audio")) + len(PB.audio_turn_open_rows()) + 12
    assert eng.conversation_history("s") == ref.engine.conversation_history("s")[:user_turn]
    assert eng.stats().free_blocks == free
    eng.check_integrity()
    extra = eng.stats().prefilled_rows - prefilled

    speak(svc, REST)
    audio, done = answer(svc, "r1")
    assert eng.conversation_history("s") == ref.engine.conversation_history("s")
    assert audio == ref_audio and done.text == ref_done.text and done.output_rows == ref_done.output_rows
    # What the false start cost: its closing and prefix rows (and the rows it generated), never the user's audio.
    close_and_prefix = len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    assert extra == close_and_prefix
    assert eng.stats().prefilled_rows - extra == ref.engine.stats().prefilled_rows
    send(svc, m.CloseSession("s"))
    assert eng.stats().free_blocks == eng.stats().total_blocks
    eng.check_integrity()


def test_a_confirmed_tentative_commit_stands_and_the_next_turn_starts_afresh():
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s", sampling=greedy(10, min_new=10)))
    speak(svc, FIRST)
    send(svc, m.CommitUserAudio("s", "item", tentative=True))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(10, min_new=10)))
    send(svc, m.ConfirmUserAudio("s"))
    assert "s" not in svc._speech._turns  # the partial code's audio is forgotten with the stream
    assert of(run(svc), m.ResponseDone)[0].status == "incomplete"
    err = send(svc, m.WithdrawResponse("s", "r0"))
    assert of(err, m.Error)[0].code == "invalid_request"  # confirmed: nothing to withdraw
    before = eng.conversation_history("s")
    speak(svc, REST)
    _, done = answer(svc, "r1")
    assert done.status == "incomplete"
    hist = eng.conversation_history("s")
    assert hist[:len(before)] == before
    enc_rows = PB.audio_turn_open_rows()
    assert any(hist[i:i + len(enc_rows)] == enc_rows for i in range(len(before), len(hist)))  # a new user turn
    eng.check_integrity()


def test_clearing_a_withdrawn_turn_takes_it_whole():
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s", sampling=greedy(10, min_new=10)))
    send(svc, m.AddUserText("s", "t", "hello"))
    send(svc, m.CreateResponse("s", "r", "text", greedy(4)))
    run(svc)
    before = eng.conversation_history("s")
    speak(svc, FIRST)
    send(svc, m.CommitUserAudio("s", "item", tentative=True))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(10, min_new=10)))
    send(svc, m.WithdrawResponse("s", "r0"))
    run(svc)
    send(svc, m.ClearUserAudio("s"))
    run(svc)
    assert eng.conversation_history("s") == before
    eng.check_integrity()
    speak(svc, REST)
    _, done = answer(svc, "r1")
    assert done.status == "incomplete"
    assert np.all(np.array(eng.conversation_history("s")[:len(before)]) == np.array(before))
    eng.check_integrity()


def after_an_answer(svc) -> None:
    """A text turn answered in audio: the answer the next tests cut."""
    send(svc, m.OpenSession("s", sampling=greedy(10, min_new=10)))
    send(svc, m.AddUserText("s", "t", "hello"))
    send(svc, m.CreateResponse("s", "a", "audio", greedy(10, min_new=10)))
    run(svc)


PLAYED = 3 * 1920  # samples of the answer heard: its first three codes (the fake decoder's 1,920 samples a code)


@pytest.mark.parametrize("withdrawn", ["mid-answer", "ended"])
def test_the_answer_before_a_withdrawn_one_is_cut_as_if_cut_before_the_user_spoke(withdrawn):
    ref = make_service()
    after_an_answer(ref)
    assert not of(send(ref, m.TruncateResponse("s", "a", PLAYED)) + run(ref), m.Error)
    speak(ref, FIRST + REST)
    ref_audio, ref_done = answer(ref, "r1")

    svc = make_service()
    eng = svc.engine
    after_an_answer(svc)
    speak(svc, FIRST)
    send(svc, m.CommitUserAudio("s", "item", tentative=True))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(10, min_new=10)))
    if withdrawn == "mid-answer":  # the cut comes before the withdrawn answer has stopped
        svc.step()
        out = send(svc, m.WithdrawResponse("s", "r0")) + send(svc, m.TruncateResponse("s", "a", PLAYED)) + run(svc)
    else:
        run(svc)
        out = send(svc, m.WithdrawResponse("s", "r0")) + run(svc)
        out += send(svc, m.TruncateResponse("s", "a", PLAYED)) + run(svc)
    assert not of(out, m.Error)
    speak(svc, REST)
    audio, done = answer(svc, "r1")
    assert eng.conversation_history("s") == ref.engine.conversation_history("s")
    assert audio == ref_audio and done.text == ref_done.text
    eng.check_integrity()
    send(svc, m.CloseSession("s"))
    assert eng.stats().free_blocks == eng.stats().total_blocks


@pytest.mark.parametrize("withdrawn", ["mid-answer", "ended"])
def test_new_instructions_during_a_withdrawn_turn_stay_their_own_item(withdrawn):
    """Instructions changed while the user speaks go in after the spoken turn, as an item of their own. A tentative
    commit of that turn, withdrawn, and the turn's final commit keep them apart: the turn's item is the commit's,
    the instructions' item stays unnamed and pinned, and an earlier item can still be deleted (the history's turns
    match its items)."""
    svc = make_service()
    after_an_answer(svc)
    speak(svc, FIRST)
    send(svc, m.UpdateSession("s", instructions="be brief"))
    send(svc, m.CommitUserAudio("s", "turn", tentative=True))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(10, min_new=10)))
    if withdrawn == "ended":
        run(svc)
    else:
        svc.step()
    send(svc, m.WithdrawResponse("s", "r0"))
    run(svc)
    speak(svc, REST)
    send(svc, m.CommitUserAudio("s", "turn"))
    send(svc, m.CreateResponse("s", "r1", "audio", greedy(10, min_new=10)))
    assert not of(run(svc), m.Error)
    s = svc.sessions["s"]
    assert [(it.item_id, it.pinned) for it in s.items] == [("t", False), ("a", False), ("turn", False), (None, True),
                                                           ("r1", False)]
    # The instructions' rows are in the conversation, after the spoken turn's end.
    history, brief = svc.engine.conversation_history("s"), PB.text_turn_rows("system", "be brief")
    at = [i for i in range(len(history)) if history[i:i + len(brief)] == brief]
    assert len(at) == 1 and history[at[0] - len(PB.audio_turn_close_rows()):at[0]] == PB.audio_turn_close_rows()
    out = send(svc, m.DeleteItem("s", "t")) + run(svc)
    assert not of(out, m.Error) and of(out, m.ItemsDropped)[0].item_ids == ["t"]
    svc.engine.check_integrity()
