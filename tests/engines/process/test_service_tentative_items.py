"""Tentative commits beside the history's items and input transcription (real tiny Engine, the fakes of
fake_service): a withdrawn answer's item leaves the items with its rows, a tentative turn is transcribed
only once it stands (whole, if it was withdrawn and went on), and no item is deleted while the turn may go on."""

from __future__ import annotations

from engines.api import SamplingParams
from engines.protocol import messages as m
from tests.engines.process.fake_service import greedy, make_service, of, run, send, speech

FIRST, REST = speech(1.01, seed=0), speech(0.6, seed=1)  # a pause mid-turn: a tentative commit after FIRST


def speak(svc, pcm: bytes) -> None:
    for i in range(0, len(pcm), 1280):  # 40 ms pieces, the engine stepping between them
        send(svc, m.AppendUserAudio("s", pcm[i:i + 1280]))
        run(svc)


def opened(pcm: bytes):
    svc = make_service()
    send(svc, m.OpenSession("s", sampling=greedy(10, min_new=10)))
    speak(svc, pcm)
    return svc


def tentative_answer(svc, rid: str) -> list:
    return (send(svc, m.CommitUserAudio("s", "item", tentative=True, transcribe=True))
            + send(svc, m.CreateResponse("s", rid, "audio", greedy(10, min_new=10))) + run(svc))


def answered(svc, rid: str) -> list:
    return (send(svc, m.CommitUserAudio("s", "item", transcribe=True))
            + send(svc, m.CreateResponse("s", rid, "audio", greedy(10, min_new=10))) + run(svc))


def item_ids(svc) -> list:
    return [it.item_id for it in svc.sessions["s"].items]


def codes(out: list) -> list[str]:
    return [x.code for x in of(out, m.Error)]


def test_a_withdrawn_answers_item_leaves_and_the_turn_is_transcribed_once_whole() -> None:
    ref = opened(FIRST + REST)
    (ref_done,) = of(answered(ref, "r1"), m.TranscriptionDone)

    svc = opened(FIRST)
    out = tentative_answer(svc, "r0")
    assert of(out, m.ResponseDone) and not of(out, m.TranscriptionDone) and not of(out, m.TranscriptionDelta)
    assert item_ids(svc) == ["item", "r0"]
    assert not of(send(svc, m.WithdrawResponse("s", "r0")) + run(svc), m.TranscriptionDone)
    s = svc.sessions["s"]
    assert item_ids(svc) == ["item"] and s.audio_item is s.items[0]  # the user's turn is open again
    assert codes(send(svc, m.DeleteItem("s", "item"))) == ["item_delete_mid_turn"]  # it may go on

    speak(svc, REST)
    (done,) = of(answered(svc, "r1"), m.TranscriptionDone)
    assert (done.status, done.item_id, done.text, done.prompt_rows) == (
        "completed", "item", ref_done.text, ref_done.prompt_rows)
    assert item_ids(svc) == item_ids(ref) == ["item", "r1"]
    # The items match the rows: deleting the user's turn cuts the history as it does without the false start.
    for x in (svc, ref):
        (dropped,) = of(send(x, m.DeleteItem("s", "item")) + run(x), m.ItemsDropped)
        assert dropped.item_ids == ["item"] and dropped.deleted
    assert svc.sessions["s"].pending_rows == ref.sessions["s"].pending_rows
    assert svc.engine.conversation_history("s") == ref.engine.conversation_history("s")
    svc.engine.check_integrity()


def test_a_confirmed_tentative_turn_is_transcribed_then_and_its_items_can_be_deleted() -> None:
    svc = opened(FIRST + REST)
    assert not of(tentative_answer(svc, "r0"), m.TranscriptionDone)
    assert codes(send(svc, m.DeleteItem("s", "item"))) == ["item_delete_mid_turn"]
    assert item_ids(svc) == ["item", "r0"]
    out = send(svc, m.ConfirmUserAudio("s")) + run(svc)
    (done,) = of(out, m.TranscriptionDone)
    assert (done.status, done.item_id) == ("completed", "item") and of(out, m.TranscriptionDelta)
    (dropped,) = of(send(svc, m.DeleteItem("s", "r0")) + run(svc), m.ItemsDropped)
    assert dropped.item_ids == ["r0"] and item_ids(svc) == ["item"]


def test_a_transcription_refused_while_it_waits_fails_alone() -> None:
    """A background request the KV pool could never hold ("no_kv") fails only its transcription: the answer asked for
    with it completes."""
    svc = opened(FIRST + REST)
    send(svc, m.CommitUserAudio("s", "item", transcribe=True))
    (rid,) = svc._transcripts
    svc.engine.scheduler.requests[rid].params = SamplingParams.greedy_params(max_new_tokens=1 << 20)
    out = send(svc, m.CreateResponse("s", "r1", "audio", greedy(10, min_new=10))) + run(svc)
    (done,) = of(out, m.TranscriptionDone)
    assert (done.status, done.code, done.output_rows) == ("failed", "server_busy", 0) and not codes(out)
    assert [d.status for d in of(out, m.ResponseDone)] == ["incomplete"]
    svc.engine.check_integrity()


def test_a_text_item_added_while_the_answer_may_be_withdrawn_stays_after_the_turn() -> None:
    """The tentative answer ended and the client added a text item before the user went on: the withdrawal takes the
    answer's item, the text item stays, and the conversation is the one a text item added mid-turn makes."""
    ref = opened(FIRST + REST)
    send(ref, m.AddUserText("s", "t1", "hello"))
    answered(ref, "r1")

    svc = opened(FIRST)
    assert of(tentative_answer(svc, "r0"), m.ResponseDone)
    assert not codes(send(svc, m.AddUserText("s", "t1", "hello")) + run(svc))
    assert item_ids(svc) == ["item", "r0", "t1"]
    send(svc, m.WithdrawResponse("s", "r0"))
    run(svc)
    assert item_ids(svc) == ["item", "t1"]
    speak(svc, REST)
    answered(svc, "r1")
    assert item_ids(svc) == item_ids(ref) == ["item", "t1", "r1"]
    assert svc.engine.conversation_history("s") == ref.engine.conversation_history("s")
    (dropped,) = of(send(svc, m.DeleteItem("s", "t1")) + run(svc), m.ItemsDropped)
    assert dropped.item_ids == ["t1"] and item_ids(svc) == ["item", "r1"]
    svc.engine.check_integrity()
