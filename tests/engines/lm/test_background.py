"""Background work in the scheduler (input transcriptions, a conversation's re-prefill after a cut), with a fake
model: it never displaces an answer's rows, never runs beside an answer's first rows, and gives its blocks back."""

from __future__ import annotations

import random

import pytest

from engines.api import InvalidRequestError, QueueFullError, SamplingParams
from engines.lm.engine import Engine
from engines.tokens import AUDIO_PAD, SOSP
from tests.engines.lm.fake_engine import make_engine, prompt, run_to_end


def spoken(n: int, base: int) -> list[tuple[int, int]]:
    """A prompt whose answer starts in audio mode (decodes launched ahead are audio rows)."""
    return prompt(n, base) + [(SOSP, AUDIO_PAD)]


def normal_workload(seed: int) -> dict[int, list[tuple[str, list, SamplingParams, bool]]]:
    """Answers (spoken and text) and users still speaking, by the count of normal steps before they arrive."""
    rng = random.Random(seed)
    out: dict[int, list] = {}
    for i in range(5):  # (few steps: sampling the tiny model's vocabulary takes ~0.1 s a step on a CPU)
        rows = spoken(rng.randint(3, 70), 1000 * i) if i % 3 else prompt(rng.randint(3, 70), 1000 * i)
        params = SamplingParams.greedy_params(max_new_tokens=rng.randint(4, 8))
        out.setdefault(rng.randint(0, 8), []).append((f"n{i}", rows, params, i != 3))
    return out


def drive(engine: Engine, seed: int, background: bool) -> tuple[list, list]:
    """Runs the workload (with background requests arriving now and then); returns each step's normal chunks
    (steps with none left out) and every step's chunks as (request, background now, starts an answer)."""
    sched = engine.scheduler
    steps: list[list] = []
    normal: list[list] = []
    run = engine.runner.run

    def record(chunks, codes):
        steps.append([(c.seq.request_id, c.seq.background, sched._starts_answer(c)) for c in chunks])
        mine = [(c.seq.request_id, c.start, c.num_rows) for c in chunks if not c.seq.background_request]
        if mine:
            normal.append(mine)
        return run(chunks, codes)

    engine.runner.run = record
    arrivals = normal_workload(seed)
    rng = random.Random(seed + 100)
    opened: list[str] = []
    k = 0
    for _ in range(5000):
        at = len(normal)
        idle = not any(not q.background_request for q in [*sched.running, *sched.waiting])
        if idle and arrivals and at not in arrivals and not opened:  # nothing to answer: the next arrivals now
            at = min(arrivals)
        for rid, rows, params, done in arrivals.pop(at, []):
            engine.add_request(rid, rows, params, input_done=done)
            if not done:
                opened.append(rid)
        if opened and at % 4 == 3:  # a speaking user's next rows, or the end of the turn
            rid = opened.pop(0)
            engine.append_input(rid, spoken(5, 77000), input_done=True)
        if background and rng.random() < 0.3 and k < 6:
            k += 1
            engine.add_request(f"t{k}", prompt(rng.randint(5, 60), 90000),
                               SamplingParams.greedy_params(max_new_tokens=rng.randint(2, 4)), background=True)
        if not arrivals and not opened and not engine.has_work():
            break
        engine.step()
        engine.check_integrity()
    assert not arrivals and not engine.has_work()
    return normal, steps


@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("overlap", [False, True])
def test_background_requests_never_displace_an_answers_rows(seed, overlap):
    """One step at a time, an answer's chunks are the same step by step with or without background requests; with
    steps launched ahead (when an arrival joins differs), background rows still never run beside an answer's first
    rows."""
    kw = dict(prefill_token_budget=64, max_running=12, blocks=1024, ramp_rows=4, ramp_step_rows=24, overlap=overlap)
    base, _ = drive(make_engine(**kw)[0], seed, background=False)
    engine, _ = make_engine(**kw)
    with_bg, steps = drive(engine, seed, background=True)
    if not overlap:
        assert with_bg == base  # the same normal chunks, step by step
    ran_bg = [s for s in steps if any(bg for _, bg, _ in s)]
    assert ran_bg  # the background requests did run...
    for s in ran_bg:  # ...but never in a step that starts an answer
        assert not any(starts for _, _, starts in s)
    st = engine.stats()
    assert st.free_blocks == st.total_blocks and st.running == st.waiting == 0


def test_background_request_gets_its_rows_and_frees_its_blocks():
    engine, model = make_engine(blocks=64)
    engine.add_request("t", prompt(9), SamplingParams.greedy_params(max_new_tokens=5), background=True)
    assert engine.num_waiting == 0 and engine.stats().waiting == 1  # no answer waits on it
    out = run_to_end(engine)
    assert [o.text_token for o in out["t"]] == [model.text_token] * 5 and out["t"][-1].finish_reason == "length"
    st = engine.stats()
    assert st.free_blocks == st.total_blocks
    with pytest.raises(InvalidRequestError, match="background"):
        engine.add_request("x", prompt(3), SamplingParams(max_new_tokens=2), conversation_id="c", background=True)


def test_a_refill_runs_as_background_then_the_turn_as_usual():
    engine, model = make_engine(prefill_token_budget=32, max_running=4, blocks=256, ramp_rows=4, ramp_step_rows=16)
    engine.add_request("a", spoken(3, 5000), SamplingParams.greedy_params(max_new_tokens=30))
    engine.step()
    engine.step()  # a ramps now
    engine.add_request("r", prompt(40) + prompt(5, 3000), SamplingParams.greedy_params(max_new_tokens=2),
                       conversation_id="c", refill_rows=40)
    seq = engine.live_request("r")
    rows_while_ramping = []
    while engine.live_request("a").num_generated < 4:
        engine.step()
        rows_while_ramping.append(seq.num_computed)
    assert set(rows_while_ramping) == {0}  # nothing of the refill beside a's first rows
    run_to_end(engine)
    assert engine.conversation_rows("c") == 47
    engine.check_integrity()


def test_a_background_request_leaves_an_eighth_of_the_slots_to_answers():
    engine, _ = make_engine(prefill_token_budget=64, max_running=8, blocks=256, ramp_rows=4)
    for i in range(7):
        engine.add_request(f"a{i}", prompt(2, 100 * i), SamplingParams.greedy_params(max_new_tokens=50))
    engine.add_request("t", prompt(4, 9000), SamplingParams.greedy_params(max_new_tokens=2), background=True)
    for _ in range(8):  # the answers past their first rows: only the slots hold it back
        engine.step()
    assert engine.live_request("t").slot < 0 and engine.stats().running == 7  # one slot of eight stays free
    engine.abort("a0")
    engine.step()
    engine.step()
    assert engine.live_request("t") is None or engine.live_request("t").slot >= 0
    engine.check_integrity()


def test_an_answer_the_pool_can_never_hold_is_refused_even_behind_a_waiting_background_request():
    """Histories hold the pool; an answer still waiting grows past what could ever be free: it is refused ("no_kv")
    although a background request that could be admitted waits ahead of it, which then runs."""
    engine, _ = make_engine(block_size=4, blocks=64)
    engine.add_request("c", prompt(200), SamplingParams.greedy_params(max_new_tokens=4), conversation_id="c")
    run_to_end(engine)
    assert engine.stats().free_blocks == 13  # the conversation holds 51 of 64 blocks
    engine.add_request("t", prompt(8, 9000), SamplingParams.greedy_params(max_new_tokens=4), background=True)
    engine.add_request("n", prompt(8, 5000), SamplingParams.greedy_params(max_new_tokens=4), input_done=False)
    engine.append_input("n", prompt(60, 6000), input_done=False)  # 18 blocks: more than could ever be free
    out = run_to_end(engine, max_steps=200)
    assert [o.finish_reason for o in out["n"]] == ["no_kv"]
    assert out["t"][-1].finish_reason == "length" and not engine.has_work()
    engine.check_integrity()


def test_a_background_request_the_pool_can_never_hold_is_refused_alone():
    engine, _ = make_engine(block_size=4, blocks=64)
    engine.add_request("c", prompt(200), SamplingParams.greedy_params(max_new_tokens=4), conversation_id="c")
    run_to_end(engine)
    engine.add_request("t", prompt(8, 9000), SamplingParams.greedy_params(max_new_tokens=4), background=True)
    engine.add_request("n", prompt(8, 5000), SamplingParams.greedy_params(max_new_tokens=4))
    engine.scheduler.requests["t"].params = SamplingParams.greedy_params(max_new_tokens=100)  # grew past the pool
    out = run_to_end(engine, max_steps=200)
    assert [o.finish_reason for o in out["t"]] == ["no_kv"] and out["n"][-1].finish_reason == "length"
    engine.check_integrity()


def test_waiting_background_requests_take_no_answers_place_in_the_queue():
    engine, _ = make_engine(max_waiting=2)
    for i in range(2):
        engine.add_request(f"t{i}", prompt(4, 100 * i), SamplingParams.greedy_params(max_new_tokens=2), background=True)
    with pytest.raises(QueueFullError):
        engine.add_request("t2", prompt(4, 900), SamplingParams.greedy_params(max_new_tokens=2), background=True)
    engine.add_request("a", prompt(4, 5000), SamplingParams.greedy_params(max_new_tokens=2))
    out = run_to_end(engine)
    assert {rid: o[-1].finish_reason for rid, o in out.items()} == {"t0": "length", "t1": "length", "a": "length"}
