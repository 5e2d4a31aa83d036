"""Instructions in the engine: new ones after the first rows are a system turn of their own, in the conversation from
the next request on; `default_instructions` goes back to the default prompt of a modality; the turns of one answer's
own instructions (and of the session's after it) are items that may leave to fit the context (`pinned=False`)."""

from __future__ import annotations

from engines.protocol import messages as m
from tests.engines.process.fake_service import PB, greedy, make_service, of, run, send


def _find(history: list, rows: list) -> list[int]:
    return [i for i in range(len(history) - len(rows) + 1) if history[i:i + len(rows)] == rows]


def _after_an_answer():
    """A session with instructions "Be kind." after one exchange (q0 -> r0): its system turn is in."""
    svc = make_service()
    send(svc, m.OpenSession("s", instructions="Be kind."))
    send(svc, m.AddUserText("s", "q0", "hello"))
    send(svc, m.CreateResponse("s", "r0", "text", greedy(2)))
    run(svc)
    return svc


def test_an_answers_own_instructions_sit_between_its_question_and_it_and_the_sessions_follow_it():
    svc = _after_an_answer()
    send(svc, m.AddUserText("s", "q", "hi"))
    send(svc, m.UpdateSession("s", instructions="Be kind. Greet.", pinned=False))
    send(svc, m.CreateResponse("s", "r1", "text", greedy(3)))
    run(svc)
    send(svc, m.UpdateSession("s", instructions="Be kind.", pinned=False))
    send(svc, m.AddUserText("s", "q2", "and?"))
    send(svc, m.CreateResponse("s", "r2", "text", greedy(3)))
    assert not of(run(svc), m.Error)
    h = svc.engine.conversation_history("s")
    own, back = PB.text_turn_rows("system", "Be kind. Greet."), PB.text_turn_rows("system", "Be kind.")
    question, second = PB.text_turn_rows("user", "hi"), PB.text_turn_rows("user", "and?")
    (q,), (o,), (first, b), (q2,) = _find(h, question), _find(h, own), _find(h, back), _find(h, second)
    assert first == 0  # the session's system turn
    assert o == q + len(question)  # right after the question, then the answer
    assert h[o + len(own):o + len(own) + len(PB.assistant_prefix_rows("text"))] == PB.assistant_prefix_rows("text")
    assert o + len(own) < b < q2 == b + len(back)  # the session's instructions after the answer, before what follows
    s = svc.sessions["s"]
    assert [(it.item_id, it.pinned) for it in s.items] == [
        ("q0", False), ("r0", False), ("q", False), (None, False), ("r1", False), (None, False), ("q2", False),
        ("r2", False)]
    svc.engine.check_integrity()


def test_default_instructions_bring_back_the_default_prompt_of_the_modality_asked():
    svc = _after_an_answer()
    send(svc, m.UpdateSession("s", default_instructions="audio"))
    send(svc, m.UpdateSession("s", default_instructions="text"))  # none already: nothing more
    send(svc, m.AddUserText("s", "q2", "and?"))
    send(svc, m.CreateResponse("s", "r2", "text", greedy(2)))
    assert not of(run(svc), m.Error)
    h = svc.engine.conversation_history("s")
    assert len(_find(h, PB.system_rows(None, "audio"))) == 1 and not _find(h, PB.system_rows(None, "text"))
    assert [(it.item_id, it.pinned) for it in svc.sessions["s"].items][-3:] == [(None, True), ("q2", False),
                                                                                ("r2", False)]


def test_default_instructions_before_the_first_rows_leave_the_default_system_turn():
    svc = make_service()
    send(svc, m.OpenSession("s", instructions="Be kind."))
    send(svc, m.UpdateSession("s", default_instructions="audio"))
    send(svc, m.AddUserText("s", "q", "hi"))
    send(svc, m.CreateResponse("s", "r1", "text", greedy(2)))
    run(svc)
    h = svc.engine.conversation_history("s")
    assert h[:len(PB.system_rows(None, "text"))] == PB.system_rows(None, "text")  # chosen by the first answer
    assert not _find(h, PB.text_turn_rows("system", "Be kind."))
