"""Rows of an open input rewritten (Engine.rewrite_input: a committed user turn's codes re-encoded): the request
then answers as if its input had been the new rows from the start, with a step launched ahead over the old rows or
without, and the KV books balance."""

from __future__ import annotations

import pytest

from engines.api import InvalidRequestError, SamplingParams
from engines.lm.engine import Engine
from engines.tokens import IM_START, text_rows
from tests.engines.lm.overlap_runs import make_engine, requests, step_into

SPEECH = text_rows([IM_START] + list(range(300, 340)))
NEW = text_rows([500, 501, 502])
REWRITE_STEP = 6  # while the answer ramps: its steps are launched ahead, with the user's next row as prefill


def drive(engine: Engine, at: int | None) -> tuple[dict[str, list], int, list, int, int]:
    """An answer ramps beside a user whose rows come one a step; at REWRITE_STEP the user's rows from `at` (None:
    its last row, which a step launched ahead is running) are rewritten. Returns the rows of each request, where
    the rewrite began and its rows, the user's rows with KV before it and those it computes again."""
    got: dict[str, list] = {"answer": [], "user": []}
    rows, _, _ = requests(5)["r1"]
    engine.add_request("answer", rows, SamplingParams.greedy_params(max_new_tokens=24, min_new_tokens=24))
    engine.add_request("user", SPEECH[:2], SamplingParams.greedy_params(max_new_tokens=4), input_done=False)
    fed, computed, redone, new = 2, -1, -1, NEW
    for step in range(200):
        if step == REWRITE_STEP:
            computed = engine.live_request("user").num_computed
            at = fed - 1 if at is None else at
            new = NEW[: fed - at]
            redone = engine.rewrite_input("user", at, new)
        if fed < len(SPEECH):
            fed += 1
            engine.append_input("user", [SPEECH[fed - 1]], input_done=fed == len(SPEECH))
        step_into(engine, got)
        if fed == len(SPEECH) and not engine.has_work():
            break
    return got, at, new, computed, redone


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("at", [3, None])  # rows with KV, or the row a step launched ahead is running
def test_a_rewritten_input_answers_as_if_it_had_been_so(tiny_checkpoint, one_torch_thread, overlap, at):
    eng = make_engine(tiny_checkpoint, overlap=overlap)
    got, at, new, computed, redone = drive(eng, at)
    assert computed > 3 + len(NEW) and redone == max(0, computed - at) and new
    ref = make_engine(tiny_checkpoint, overlap=False)
    ref.add_request("user", SPEECH[:at] + new + SPEECH[at + len(new):], SamplingParams.greedy_params(max_new_tokens=4))
    want: dict[str, list] = {"user": []}
    while ref.has_work():
        step_into(ref, want)
    assert got["user"] == want["user"] and len(want["user"]) == 4
    plain = make_engine(tiny_checkpoint, overlap=False)
    assert got["answer"] == drive(plain, at)[0]["answer"]  # untouched
    if overlap:
        assert eng.stats().overlapped_steps >= REWRITE_STEP
    eng.check_integrity()
    assert eng.scheduler.pool.num_free == eng.scheduler.pool.num_blocks


def test_only_a_live_input_not_yet_answered_is_rewritten(tiny_checkpoint, one_torch_thread):
    eng = make_engine(tiny_checkpoint, overlap=False)
    eng.add_request("user", SPEECH, SamplingParams.greedy_params(max_new_tokens=4))
    eng.step()
    computed = eng.live_request("user").num_computed
    assert computed > 3 and eng.rewrite_input("user", 3, NEW) == computed - 3
    while eng.live_request("user").num_generated == 0:
        eng.step()
    with pytest.raises(InvalidRequestError):
        eng.rewrite_input("user", 3, NEW)
    with pytest.raises(InvalidRequestError):
        eng.rewrite_input("nobody", 3, NEW)
