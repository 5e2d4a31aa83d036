"""The paged engine against the dense reference (greedy): each row, on both channels, is the reference's (near-ties
either way)."""

from __future__ import annotations

import random

import pytest

from engines.api import SamplingParams
from engines.tokens import IM_END, IM_START, text_rows
from tests.engines.lm.parity import assert_follows, greedy, make_engine, make_prompt
from tests.reference.dense_model import dense_from_checkpoint


@pytest.fixture(scope="module")
def dense(tiny_checkpoint):
    return dense_from_checkpoint(tiny_checkpoint)


@pytest.mark.parametrize("block_size", [1, 16])
def test_batched_engine_matches_dense_reference(tiny_checkpoint, dense, block_size):
    rng = random.Random(block_size)
    kinds = ["text", "audio_in", "audio_out", "audio_in_audio_out"]
    reqs = {f"r{i}": make_prompt(rng, kinds[i % 4]) for i in range(8)}
    join_step = {rid: rng.randint(0, 12) for rid in reqs}
    join_step["r0"] = 0
    engine = make_engine(tiny_checkpoint, block_size, max_running=8, prefill_token_budget=48)
    got: dict[str, list] = {rid: [] for rid in reqs}
    step = 0
    while step < 500:
        for rid, at in join_step.items():
            if at == step:
                engine.add_request(rid, reqs[rid], greedy())
        for o in engine.step():
            got[o.request_id].append((o.text_token, o.audio_token, o.mode))
        engine.check_integrity()
        step += 1
        if step > max(join_step.values()) and not engine.has_work():
            break
    for rid, rows in reqs.items():
        assert_follows(dense, rows, got[rid])
    assert any(m == "audio" for rows in got.values() for _, _, m in rows)
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_second_turn_on_cached_history_matches_dense(tiny_checkpoint, dense):
    rng = random.Random(3)
    engine = make_engine(tiny_checkpoint, 16, max_running=4, prefill_token_budget=64)
    turn1 = make_prompt(rng, "audio_in")
    engine.add_request("t1", turn1, greedy(20), conversation_id="c")
    while engine.has_work():
        engine.step()
    history = engine.conversation_history("c")
    assert len(history) == len(turn1) + 20
    turn2 = text_rows([IM_END]) + make_prompt(rng, "audio_in_audio_out")
    before = engine.stats().prefilled_rows
    engine.add_request("t2", turn2, greedy(24, min_new=24), conversation_id="c")
    got = []
    while engine.has_work():
        got += [(o.text_token, o.audio_token, o.mode) for o in engine.step()]
    # Only the new rows (and turn 1's last generated row, never run) were prefilled.
    assert engine.stats().prefilled_rows - before == len(turn2) + 1
    assert_follows(dense, history + turn2, got, steps=24, min_new=24)


def test_seeded_sampling_reproduces_across_batch_compositions(tiny_checkpoint):
    rng = random.Random(5)
    prompt = make_prompt(rng, "audio_in")
    params = SamplingParams(max_new_tokens=24, seed=1234)

    def run(extra: int) -> list:
        engine = make_engine(tiny_checkpoint, 16, max_running=8, prefill_token_budget=128)
        for i in range(extra):
            engine.add_request(f"x{i}", make_prompt(rng, "text"), SamplingParams(max_new_tokens=24, seed=i))
        engine.add_request("me", prompt, params)
        out = []
        while engine.has_work():
            out += [(o.text_token, o.audio_token) for o in engine.step() if o.request_id == "me"]
        return out

    alone = run(0)
    assert alone == run(3)
    assert len(alone) > 0


def test_steps_count_in_the_bucket_of_their_rows(tiny_checkpoint) -> None:
    """EngineStats counts each launched step and its rows in the bucket of its row count (the load log's histogram):
    a 20-row prompt in one step is a 17-32-row step, its decodes 1-row steps; stats() hands out copies."""
    from engines.api import STEP_ROW_BUCKETS, step_row_bucket

    assert [step_row_bucket(r) for r in (1, 16, 17, 32, 33, 64, 65, 128, 129)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    eng = make_engine(tiny_checkpoint, block_size=16, overlap=False)
    eng.add_request("a", text_rows([IM_START, *range(300, 318), IM_END]), greedy(3, min_new=3))
    while eng.has_work():
        eng.step()
    st = eng.stats()
    assert st.step_row_counts == [2, 1, 0, 0, 0] and st.step_row_sums == [2, 20, 0, 0, 0]
    assert len(st.step_row_counts) == len(STEP_ROW_BUCKETS) + 1 and sum(st.step_row_counts) == st.steps
    st.step_row_counts[0] += 5  # the caller's copy
    assert eng.stats().step_row_counts == [2, 1, 0, 0, 0]


def test_launch_gaps_count_host_time_between_steps_with_work_left(tiny_checkpoint, monkeypatch) -> None:
    """The host time from a step's tokens to the next launch (the load log's gap) is counted only while work was
    scheduled: the idle time after the last step is not a gap."""
    import engines.lm.engine as engine_mod

    clock = [0.0]
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: clock[0])
    eng = make_engine(tiny_checkpoint, block_size=16, overlap=False)
    run = eng.runner.run

    def launch(*a, **k):  # each launch takes 1 ms of host time (the load log's "ms per launch")
        clock[0] += 0.001
        return run(*a, **k)

    monkeypatch.setattr(eng.runner, "run", launch)
    eng.add_request("a", text_rows([IM_START, 5, 6, IM_END]), greedy(4, min_new=4))
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        clock[0] += 0.003  # 3 ms of host work before the next step
    st = eng.stats()
    assert steps == 4 and st.launch_gaps == 3  # the prefill samples the 1st token, 3 decodes; none after the last
    assert st.launch_gap_s == pytest.approx(3 * 0.003)
    assert st.steps == 4 and st.launch_s == pytest.approx(4 * 0.001)
    clock[0] += 10.0  # idle, then a new request: not a gap
    eng.add_request("b", text_rows([IM_START, 7, IM_END]), greedy(1, min_new=1))
    eng.step()
    assert eng.stats().launch_gaps == 3
