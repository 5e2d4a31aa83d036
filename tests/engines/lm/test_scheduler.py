"""Scheduler, KV pool and engine bookkeeping with a fake model runner."""

from __future__ import annotations

import random

import pytest

from engines.api import InvalidRequestError, QueueFullError, RequestTooLargeError, SamplingParams
from engines.config import ConfigError, EngineConfig
from engines.lm.kv.block_pool import BlockPool, KVIntegrityError
from tests.engines.lm.fake_engine import MC, make_engine, prompt, run_to_end


def test_engine_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="prefill_token_budget"):
        EngineConfig(prefill_token_budget=8, max_running=16)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ConfigError, match="ramp_step_rows"):
        EngineConfig(ramp_step_rows=-1)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_token_budget_kept_and_decodes_never_starved():
    engine, model = make_engine(prefill_token_budget=24, max_running=8, blocks=256)
    engine.add_request("a", prompt(5), SamplingParams.greedy_params(max_new_tokens=30))
    engine.step()  # a prefilled, now decoding
    for i in range(4):
        engine.add_request(f"long{i}", prompt(50), SamplingParams.greedy_params(max_new_tokens=3))
    a_rows = 1
    while engine.has_work():
        before = len(model.batches)
        outs = engine.step()
        if len(model.batches) > before:
            b = model.batches[-1]
            assert b.num_rows <= 24
        if any(o.request_id == "a" for o in outs):
            a_rows += 1
        elif engine.live_request("a") is not None:
            pytest.fail("running request 'a' was not decoded in a step")
        engine.check_integrity()
    assert a_rows == 30


def test_steps_stay_short_while_an_answer_ramps_and_complete_inputs_go_first():
    """While a sequence is in its first ramp_rows generated rows, a step carries at most ramp_step_rows rows (its
    prefill at least RAMP_MIN_PREFILL, however many decode) of decodes and open inputs; with no answer ramping, the
    whole budget again. Prefill takes sequences whose input is complete before older ones still open (a user still
    speaking), and a complete input is not held to the cap: its answer waits on its rows as the ramping one waits on
    its steps."""
    from engines.lm.scheduler import RAMP_MIN_PREFILL

    engine, model = make_engine(prefill_token_budget=200, max_running=8, blocks=512, ramp_rows=4, ramp_step_rows=24)
    engine.add_request("speaking", prompt(5), SamplingParams.greedy_params(10), input_done=False)
    engine.add_request("done", prompt(5, base=3000), SamplingParams.greedy_params(30), input_done=False)
    engine.step()  # both prompts so far prefilled
    engine.add_request("a", prompt(3, base=5000), SamplingParams.greedy_params(max_new_tokens=40))
    engine.step()  # a's prompt and its first row: a ramps now
    engine.append_input("speaking", prompt(150, base=2000), input_done=False)
    engine.append_input("done", prompt(60, base=4000), input_done=True)  # the newer one, complete (committed)
    seqs = {s.request_id: s for s in engine.scheduler.running}
    pending = []
    while seqs["speaking"].num_pending:
        ramping = any(s.generating and s.num_generated < 4 for s in engine.scheduler.running)
        complete = seqs["done"].num_pending - 1  # (its first generated row is pending, as a decode)
        engine.step()
        pending.append((seqs["done"].num_pending, seqs["speaking"].num_pending))
        assert model.batches[-1].num_rows <= (24 + complete if ramping else 200)
        engine.check_integrity()
    # done first, all of it in one step beside a; then 22 of speaking's rows a step beside a and done's decodes
    assert pending[:3] == [(1, 150), (1, 128), (1, 106)]
    assert model.batches[-1].num_rows > 24  # no answer ramps by then: the rest in one step
    engine.abort("speaking")
    run_to_end(engine)
    engine.check_integrity()
    # many decoding sequences still leave the ramp minimum of prefill
    engine, model = make_engine(prefill_token_budget=200, max_running=40, blocks=2048, ramp_rows=100,
                                ramp_step_rows=24)
    for i in range(30):
        engine.add_request(f"d{i}", prompt(1, base=100 * i), SamplingParams.greedy_params(max_new_tokens=50))
    engine.step()
    engine.add_request("long", prompt(100, base=9000), SamplingParams.greedy_params(max_new_tokens=2))
    engine.step()
    assert model.batches[-1].num_rows == 30 + RAMP_MIN_PREFILL
    engine.check_integrity()


@pytest.mark.parametrize("via", ["add_request", "append_input"])
def test_an_answer_ramps_for_the_rows_its_request_says(via):
    """An answer whose first audio waits for more codes than the engine's default ramp (a full-context decoder's first
    job past a voice prompt's tail: 10 codes with the bundled voice) keeps its steps short for that many rows, set
    when its request comes in or when its input closes (a spoken turn's answer)."""
    engine, model = make_engine(prefill_token_budget=200, max_running=8, blocks=512, ramp_rows=4, ramp_step_rows=24)
    engine.add_request("speaking", prompt(5), SamplingParams.greedy_params(60), input_done=False)
    if via == "add_request":
        engine.add_request("a", prompt(3, base=5000), SamplingParams.greedy_params(max_new_tokens=40), ramp_rows=10)
    else:
        engine.add_request("a", prompt(3, base=5000), SamplingParams.greedy_params(40), input_done=False)
        engine.step()
        engine.append_input("a", prompt(2, base=6000), input_done=True, ramp_rows=10)
    engine.step()  # a's prompt and its first row
    a = engine.live_request("a")
    sizes = []
    while a.num_generated < 12:
        engine.append_input("speaking", prompt(100, base=1000 + 100 * a.num_generated), input_done=False)
        generated = a.num_generated
        engine.step()
        sizes.append((generated, model.batches[-1].num_rows))
        engine.check_integrity()
    assert all(rows <= 24 for g, rows in sizes if g < 10), sizes  # ramping: a's 2nd to 10th rows
    assert all(rows > 24 for g, rows in sizes if g >= 10), sizes  # then the whole budget again


def test_chunked_prefill_positions_and_slots():
    engine, model = make_engine(block_size=4, prefill_token_budget=10, max_running=4)
    engine.add_request("a", prompt(23), SamplingParams.greedy_params(max_new_tokens=2))
    run_to_end(engine)
    seen = sorted(p for b in model.batches for p in b.positions.tolist())
    assert seen == list(range(24))  # 23 prompt rows + the first generated row, each once
    assert [b.num_rows for b in model.batches] == [10, 10, 3, 1]


def test_queue_overflow_refused_with_typed_error():
    engine, _ = make_engine(max_waiting=2, max_running=2, prefill_token_budget=8)
    params = SamplingParams(max_new_tokens=4)
    engine.add_request("a", prompt(4), params)
    engine.add_request("b", prompt(4), params)
    with pytest.raises(QueueFullError):
        engine.add_request("c", prompt(4), params)
    assert QueueFullError.code == "server_busy"


def test_request_too_large_and_bad_rows_refused():
    engine, _ = make_engine(blocks=8, block_size=4, max_model_len=4096)
    with pytest.raises(RequestTooLargeError):
        engine.add_request("big", prompt(30), SamplingParams(max_new_tokens=10))
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.add_request("bad", [(MC.vocab_size, 0)], SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="pair"):
        engine.add_request("bad2", [(1,)], SamplingParams(max_new_tokens=2))
    engine.add_request("dup", prompt(2), SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="already live"):
        engine.add_request("dup", prompt(2), SamplingParams(max_new_tokens=2))


def test_admission_waits_for_reservation_and_never_preempts():
    # 12 blocks of 4 rows: each request needs ceil((8 + 12) / 4) = 5 blocks, so two fit at once.
    engine, _ = make_engine(blocks=12, block_size=4, max_running=8, prefill_token_budget=32)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(8), SamplingParams.greedy_params(max_new_tokens=12))
    first = engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 2
    assert engine.num_waiting == engine.stats().waiting == 2  # (what the service loop reads every step)
    out = run_to_end(engine)
    for o in first:
        out[o.request_id].insert(0, o)
    assert {k: len(v) for k, v in out.items()} == {f"r{i}": 12 for i in range(4)}
    assert engine.scheduler.pool.num_free == 12


def test_cancel_storm_returns_every_block():
    rng = random.Random(7)
    engine, _ = make_engine(blocks=400, block_size=4, max_running=32, prefill_token_budget=64, max_waiting=200)
    start_free = engine.scheduler.pool.num_free
    budgets = {f"r{i}": rng.randint(1, 20) for i in range(100)}
    pending = list(budgets)
    abort_at = {rid: rng.randint(0, budgets[rid]) for rid in rng.sample(pending, 10)}
    # one of them aborts exactly at its last step
    last = next(iter(abort_at))
    abort_at[last] = budgets[last]
    produced: dict[str, int] = {rid: 0 for rid in budgets}
    finished: dict[str, str] = {}
    step = 0
    while pending or engine.has_work():
        for _ in range(rng.randint(0, 6)):
            if pending:
                rid = pending.pop(0)
                engine.add_request(rid, prompt(rng.randint(1, 30)), SamplingParams.greedy_params(budgets[rid]))
        for o in engine.step():
            if o.finish_reason != "abort":
                produced[o.request_id] += 1
            if o.finished:
                finished[o.request_id] = o.finish_reason
        for rid, at in abort_at.items():
            if rid not in finished and produced[rid] >= at and rid not in pending:
                engine.abort(rid)
        engine.check_integrity()
        step += 1
        assert step < 5000
    for rid, n in budgets.items():
        if rid in abort_at and finished[rid] == "abort":
            assert produced[rid] <= n
        else:
            assert produced[rid] == n and finished[rid] == "length", rid
    assert engine.scheduler.pool.num_free == start_free
    assert engine.scheduler.pool.reserved == 0
    assert not engine.scheduler.requests


def test_abort_waiting_and_unknown():
    engine, _ = make_engine(max_running=1, prefill_token_budget=8)
    engine.add_request("a", prompt(3), SamplingParams.greedy_params(5))
    engine.add_request("b", prompt(3), SamplingParams.greedy_params(5))
    engine.step()
    assert engine.abort("b") is True
    outs = engine.step()
    assert any(o.request_id == "b" and o.finish_reason == "abort" for o in outs)
    assert engine.abort("nope") is False
    run_to_end(engine)
    engine.check_integrity()


def test_conversation_keeps_history_blocks_and_prefills_only_new_rows():
    engine, model = make_engine(block_size=4, blocks=64)
    engine.add_request("t1", prompt(10), SamplingParams.greedy_params(6), conversation_id="c")
    run_to_end(engine)
    assert engine.conversation_rows("c") == 16
    assert engine.conversation_unrun_rows("c") == 1  # the last sampled row has no KV yet
    held = len(engine.scheduler.conversations["c"].block_ids)
    assert engine.scheduler.pool.num_used == held == 4  # 15 computed rows -> 4 blocks
    model.batches.clear()
    before = engine.stats().prefilled_rows
    engine.add_request("t2", prompt(5, base=2000), SamplingParams.greedy_params(3), conversation_id="c")
    run_to_end(engine)
    # turn 2 runs the last generated row of turn 1 plus its 5 new rows, not the 16-row history
    assert engine.stats().prefilled_rows - before == 6
    assert model.batches[0].positions.tolist() == list(range(15, 21))
    engine.truncate_conversation("c", 9)
    assert engine.conversation_rows("c") == 9
    engine.check_integrity()
    engine.release_conversation("c")
    assert engine.scheduler.pool.num_free == 64
    with pytest.raises(InvalidRequestError):
        engine.release_conversation("c")


def test_open_input_waits_then_generates():
    engine, model = make_engine(block_size=4)
    engine.add_request("a", prompt(3), SamplingParams.greedy_params(2), input_done=False)
    assert engine.step() == []
    assert not engine.has_work()
    engine.append_input("a", prompt(2, base=3000), input_done=False)
    assert engine.step() == []
    engine.append_input("a", prompt(1, base=4000), input_done=True)
    out = run_to_end(engine)
    assert len(out["a"]) == 2
    assert sum(b.num_rows for b in model.batches) == 6 + 1
    with pytest.raises(InvalidRequestError):
        engine.append_input("a", prompt(1))
    engine.check_integrity()


def test_block_pool_integrity_detects_corruption():
    pool = BlockPool(4)
    assert pool.reserve(2)
    blocks = pool.allocate_reserved(2)
    pool.check_integrity([blocks])
    with pytest.raises(KVIntegrityError):
        pool.check_integrity([blocks, blocks[:1]])
    pool.release(blocks)
    with pytest.raises(KVIntegrityError):
        pool.release(blocks[:1])


def test_append_input_can_replace_sampling_params_and_reservation_follows():
    engine, _ = make_engine(block_size=4, blocks=64)
    engine.add_request("a", prompt(3), SamplingParams.greedy_params(40), input_done=False)
    engine.step()
    pool = engine.scheduler.pool
    assert pool.reserved + pool.num_used == 11  # ceil((3 + 40) / 4)
    engine.append_input("a", prompt(2, base=3000), input_done=True, params=SamplingParams.greedy_params(5))
    assert pool.reserved + pool.num_used == 3  # ceil((5 + 5) / 4)
    engine.check_integrity()
    out = run_to_end(engine)
    assert len(out["a"]) == 5
    assert pool.num_free == 64
