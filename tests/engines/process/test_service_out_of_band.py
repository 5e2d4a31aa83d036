"""An out-of-band answer (GA `conversation: "none"`): the model answers the conversation as it stands, then its rows
leave the history. What the conversation holds afterwards, and every later answer, is what it would be had the
out-of-band answer never been asked for."""

from __future__ import annotations

import pytest

from engines.protocol import messages as m
from tests.engines.process.fake_service import greedy, make_service, of, run, send, speech


def _conversation(svc, out_of_band: str | None, cancel: bool = False, instructions: str | None = None):
    """hello -> r0; q1; an out-of-band answer (if any, with its own `instructions`), then q2 -> r2."""
    send(svc, m.OpenSession("s", instructions="Be kind."))
    send(svc, m.AddUserText("s", "q0", "hello"))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(6)))
    run(svc)
    send(svc, m.AddUserText("s", "q1", "what time is it?"))
    if out_of_band is not None:
        send(svc, m.CreateResponse("s", "oob", out_of_band, greedy(8, min_new=8), out_of_band=True,
                                   instructions=instructions))
        if cancel:
            svc.step()
            send(svc, m.CancelResponse("s", "oob"))
        done = of(run(svc), m.ResponseDone)
        assert [d.response_id for d in done] == ["oob"] and done[0].output_rows > 0
    after_oob = list(svc.engine.conversation_history("s"))
    send(svc, m.AddUserText("s", "q2", "and now?"))
    send(svc, m.CreateResponse("s", "r2", "text", greedy(6)))
    out = run(svc)
    return after_oob, of(out, m.TextDelta), of(out, m.ResponseDone)[0]


@pytest.mark.parametrize(("modality", "cancel", "instructions"), [
    ("text", False, None), ("audio", False, None), ("audio", True, None), ("text", False, "Answer in one word."),
    ("audio", True, "Answer in one word.")])
def test_an_out_of_band_answer_leaves_the_conversation_as_if_never_asked(modality, cancel, instructions):
    plain_svc, oob_svc = make_service(), make_service()
    _, plain_text, plain_done = _conversation(plain_svc, None)
    after_oob, text, done = _conversation(oob_svc, modality, cancel, instructions)
    plain_history, history = plain_svc.engine.conversation_history("s"), oob_svc.engine.conversation_history("s")
    assert history == plain_history and text == plain_text
    assert (done.output_rows, done.status) == (plain_done.output_rows, plain_done.status)
    # Right after it, the history ends with the item it answered (what q1 brought), nothing of its own.
    assert plain_history[:len(after_oob)] == after_oob
    s = oob_svc.sessions["s"]
    assert [it.item_id for it in s.items] == ["q0", "r0", "q1", "q2", "r2"]
    oob_svc.engine.check_integrity()
    send(oob_svc, m.CloseSession("s"))
    assert oob_svc.engine.stats().free_blocks == oob_svc.engine.stats().total_blocks


def test_an_out_of_band_answer_after_a_spoken_turn_keeps_the_turn():
    svc = make_service()
    send(svc, m.OpenSession("s"))
    pcm = speech(1.0)
    for i in range(0, len(pcm), 1280):
        send(svc, m.AppendUserAudio("s", pcm[i:i + 1280]))
        run(svc)
    send(svc, m.CommitUserAudio("s", "turn"))
    run(svc)
    turn = list(svc.engine.conversation_history("s"))
    send(svc, m.CreateResponse("s", "oob", "text", greedy(5, min_new=5), out_of_band=True))
    assert of(run(svc), m.ResponseDone)[0].output_rows == 5
    history = svc.engine.conversation_history("s")
    assert history[:len(turn)] == turn and len(history) >= len(turn)
    assert [it.item_id for it in svc.sessions["s"].items] == ["turn"]
    # The turn is still the one to answer: an answer in the conversation now follows it directly.
    send(svc, m.CreateResponse("s", "r1", "text", greedy(3)))
    assert not of(run(svc), m.Error)
    assert [it.item_id for it in svc.sessions["s"].items] == ["turn", "r1"]
    svc.engine.check_integrity()


def test_an_out_of_band_answer_cannot_be_truncated_and_leaves_no_answer_to_cut():
    svc = make_service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "q0", "hello"))
    send(svc, m.CreateResponse("s", "oob", "audio", greedy(6, min_new=6), out_of_band=True))
    run(svc)
    out = send(svc, m.TruncateResponse("s", "oob", 100))
    assert of(out, m.Error) and of(out, m.Error)[0].code == "invalid_request"


def test_an_out_of_band_answer_s_own_instructions_are_its_prompt_and_leave_with_it():
    """They go in as a system turn right before the answer's header (the session's stay as they were), as the first
    answer of a session too; afterwards the history is the plain one's."""
    seen = {}
    for instructions in (None, "Answer in one word."):
        svc = make_service()
        send(svc, m.OpenSession("s", instructions="Be kind."))
        send(svc, m.AddUserText("s", "q0", "hello"))
        out = send(svc, m.CreateResponse("s", "oob", "text", greedy(4, min_new=4), out_of_band=True,
                                         instructions=instructions)) + run(svc)
        seen[instructions] = (of(out, m.ResponseStarted)[0].prompt_rows, svc.engine.conversation_history("s"))
        assert svc.sessions["s"].instructions == "Be kind." and [it.item_id for it in svc.sessions["s"].items] == \
            ["q0"]
        svc.engine.check_integrity()
    own = len(svc.prompts.system_rows("Answer in one word.", "text"))
    assert seen["Answer in one word."][0] == seen[None][0] + own
    assert seen["Answer in one word."][1] == seen[None][1]


def test_instructions_of_one_answer_in_the_conversation_are_refused():
    svc = make_service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "q0", "hello"))
    out = send(svc, m.CreateResponse("s", "r0", "text", greedy(4), instructions="Answer in one word."))
    assert [e.code for e in of(out, m.Error)] == ["invalid_request"]
    assert [(d.response_id, d.status) for d in of(out, m.ResponseDone)] == [("r0", "failed")]
    send(svc, m.CreateResponse("s", "r1", "text", greedy(3)))  # the conversation goes on as it was
    out = run(svc)
    assert not of(out, m.Error) and [d.response_id for d in of(out, m.ResponseDone)] == ["r1"]
    assert [it.item_id for it in svc.sessions["s"].items] == ["q0", "r1"]
