"""Overlapped decode (the next audio step launched before this one's tokens are read) changes nothing:
the same rows, modes and finish reasons per request as one step at a time, and every KV block back."""

from __future__ import annotations

import random

import pytest
import torch

from engines.api import ChannelSampling, SamplingParams
from engines.lm.engine import Engine
from engines.tokens import AUDIO_PAD, IM_END, IM_START, SOSP, text_rows
from tests.engines.lm.overlap_runs import ending_beside_ramping, make_engine, requests, run, step_into


@pytest.mark.parametrize("seed", [0, 1])
def test_overlapped_decode_emits_the_same_rows(tiny_checkpoint, one_torch_thread, seed):
    reqs = requests(seed)
    plain = make_engine(tiny_checkpoint, overlap=False)
    ref = run(plain, reqs)
    eng = make_engine(tiny_checkpoint, overlap=True)
    got = run(eng, reqs)
    assert got == ref
    modes = {rid: {r[2] for r in rows} for rid, rows in ref.items()}
    assert all(m == {"audio", "text"} for m in modes.values()), "every answer should switch modes"
    assert eng.stats().overlapped_steps > 0 and plain.stats().overlapped_steps == 0
    # The overlapped engine may hold one extra block per conversation (a dropped row's KV); all else is free.
    for e in (plain, eng):
        held = sum(len(c.block_ids) for c in e.scheduler.conversations.values())
        assert e.stats().free_blocks + held == e.stats().total_blocks
        for cid in list(e.scheduler.conversations):
            e.release_conversation(cid)
        assert e.stats().free_blocks == e.stats().total_blocks
        e.check_integrity()


def test_first_decode_step_is_launched_with_the_prefill(tiny_checkpoint, one_torch_thread):
    """A spoken prompt's prefill step already launches its first decode step (whose input row is the prefill's
    sample, still on the device); a text prompt's does not (its first row may be text)."""
    rows, params, _ = requests(4)["r1"]
    eng = make_engine(tiny_checkpoint, overlap=True)
    eng.add_request("spoken", rows, params)
    first = eng.step()
    assert [o.request_id for o in first] == ["spoken"] and eng._inflight is not None
    assert eng.stats().overlapped_steps == 1
    got = [(o.text_token, o.audio_token, o.mode, o.finish_reason) for o in first]
    while eng.has_work():
        got += [(o.text_token, o.audio_token, o.mode, o.finish_reason) for o in eng.step()]
    plain = make_engine(tiny_checkpoint, overlap=False)
    assert got == run(plain, {"spoken": (rows, params, 0)})["spoken"]
    text_prompt = rows[:-1] + text_rows([IM_END])
    eng.add_request("text", text_prompt, params)
    eng.step()
    assert eng._inflight is None
    while eng.has_work():
        eng.step()
    eng.check_integrity()


def test_abort_while_a_step_is_in_flight(tiny_checkpoint, one_torch_thread):
    reqs = requests(2)
    eng = make_engine(tiny_checkpoint, overlap=True)
    got = run(eng, reqs, abort_at={rid: at + 4 for rid, (_, _, at) in reqs.items()})
    for rows in got.values():
        assert rows[-1][3] in ("abort", "length", "stop")
        assert sum(1 for r in rows if r[3] is not None) == 1  # exactly one finished row
    assert any(rows[-1][3] == "abort" for rows in got.values())
    for cid in list(eng.scheduler.conversations):
        eng.release_conversation(cid)
    assert eng.stats().free_blocks == eng.stats().total_blocks
    eng.check_integrity()


@pytest.mark.parametrize("seed", range(8))
def test_random_schedules_overlap_equals_one_step_at_a_time(tiny_checkpoint, one_torch_thread, seed):
    """Requests that join late, stream their input over several steps, sample or decode greedily, switch modes
    and are aborted at random: every request gets the same rows with and without overlapped decode, the KV
    books balance after every step, and every block comes back."""
    rng = random.Random(1000 + seed)
    plan = []
    for i in range(rng.randint(4, 8)):
        rows = text_rows([IM_START] + [rng.randrange(200, 150000) for _ in range(rng.randint(2, 10))])
        rows += [(SOSP, AUDIO_PAD)]
        max_new = rng.randint(3, 25)
        min_new = rng.randint(0, max_new)
        ch = ChannelSampling(temperature=rng.choice([0.0, 0.7, 1.2]), top_k=rng.choice([0, 5, 40]))
        params = SamplingParams(text=ch, audio=ch, max_new_tokens=max_new, min_new_tokens=min_new, seed=i)
        split = rng.randint(1, len(rows))  # the rest arrives one row per step, the last closes the input
        plan.append((f"q{i}", rows, split, params, rng.randint(0, 20), rng.choice([None, rng.randint(1, 30)])))

    def drive(engine: Engine) -> dict[str, list]:
        got: dict[str, list] = {rid: [] for rid, *_ in plan}
        feeding: dict[str, list] = {}
        for step in range(300):
            for rid, rows, split, params, join, abort_after in plan:
                if step == join:
                    engine.add_request(rid, rows[:split], params, input_done=split == len(rows))
                    feeding[rid] = rows[split:]
                if abort_after is not None and step == join + abort_after:
                    engine.abort(rid)
            for rid, rest in list(feeding.items()):
                if engine.live_request(rid) is None or engine.scheduler.aborting(rid):
                    rest.clear()  # aborted: no more input is taken
                if rest:
                    engine.append_input(rid, [rest.pop(0)], input_done=not rest)
                if not rest:
                    del feeding[rid]
            step_into(engine, got)
            if step > 20 and not feeding and not engine.has_work():  # (input still to come: more work later)
                break
        assert not engine.has_work()
        return got

    plain, eng = make_engine(tiny_checkpoint, overlap=False), make_engine(tiny_checkpoint, overlap=True)
    got, ref = drive(eng), drive(plain)
    for rid, want in ref.items():
        have = got[rid]
        if any(rows and rows[-1][3] == "abort" for rows in (have, want)):
            # With overlap a request's rows can run up to two steps later or earlier than one step at a time: rows
            # appended while a step is in flight run a step later (the step launched ahead holds the rows known at
            # its launch), and a request that arrives then is admitted a step later outside a ramp, or into the
            # step launched ahead during one. So an abort timed by steps may cut an answer up to two rows apart.
            a, b = sorted((r[:-1] if r and r[-1][3] == "abort" else r for r in (have, want)), key=len)
            assert b[:len(a)] == a and len(b) - len(a) <= 2, rid
        else:
            assert have == want, rid
    assert eng.stats().overlapped_steps > 0  # the schedules do reach all-audio stretches
    for e in (plain, eng):
        assert e.stats().free_blocks == e.stats().total_blocks  # no conversations: everything returned
        e.check_integrity()


def test_pending_tokens_call_on_wait_until_the_step_is_done_or_it_declines():
    """While a step runs on the GPU, `on_wait` is called again and again (the engine loop sends audio then), until
    the step is done or on_wait returns False; then the read waits for the step as before."""
    from engines.lm.runner import PendingTokens

    class StepEvent:  # done after `busy` queries
        def __init__(self, busy):
            self.busy, self.synced = busy, 0

        def query(self):
            self.busy -= 1
            return self.busy < 0

        def synchronize(self):
            self.synced += 1

    def read(busy, keep_polling):
        pending = PendingTokens(torch.tensor([[7, 8]]))
        pending._event = StepEvent(busy)
        calls = []
        rows = pending.get(lambda: calls.append(1) or keep_polling)
        return rows, len(calls), pending._event.synced

    assert read(3, True) == ([(7, 8)], 3, 1)  # polled while busy, then read
    assert read(3, False) == ([(7, 8)], 1, 1)  # declined: waited for the step at once
    assert read(0, True) == ([(7, 8)], 0, 1)  # done already: no call


def test_steps_are_launched_ahead_beside_a_user_still_speaking(tiny_checkpoint, one_torch_thread):
    """An answer ramps (its first `ramp_rows` rows, which its first audio waits on) while another user's input
    arrives a row per step (an open input): the next step is still launched before this one's tokens are read,
    with the speaking user's known rows as its prefill, and both requests get the rows they get one step at a
    time. Past the ramp, steps beside prefill wait for the tokens again."""
    rows, _, _ = requests(5)["r1"]
    params = SamplingParams.greedy_params(max_new_tokens=24, min_new_tokens=24)  # audio to the end (make_engine)
    speech = text_rows([IM_START] + list(range(300, 340)))

    def drive(engine: Engine) -> dict[str, list]:
        got: dict[str, list] = {"answer": [], "user": []}
        engine.add_request("answer", rows, params)
        engine.add_request("user", speech[:2], SamplingParams.greedy_params(max_new_tokens=4), input_done=False)
        fed = 2
        for _ in range(200):
            if fed < len(speech):
                fed += 1
                engine.append_input("user", [speech[fed - 1]], input_done=fed == len(speech))
            step_into(engine, got)
            if not engine.has_work():
                break
        return got

    plain, eng = make_engine(tiny_checkpoint, overlap=False), make_engine(tiny_checkpoint, overlap=True)
    ref = drive(plain)
    assert drive(eng) == ref
    ramp = eng.config.ramp_rows
    assert len(ref["answer"]) > ramp + 4 and len(speech) > len(ref["answer"]) + 4  # the user speaks throughout
    # The ramp's steps after the first launched ahead (before, none did while the user spoke); later ones did not.
    assert ramp - 2 <= eng.stats().overlapped_steps <= ramp
    # ... and the stats say why: prefill beside decodes with no answer ramping, never while it ramped
    st = eng.stats()
    assert st.ahead_refused.get("prefill, no ramp", 0) >= 4 and st.ahead_refused_ramping == {}, st.ahead_refused
    eng.check_integrity()


def test_a_request_arriving_while_an_answer_ramps_joins_the_step_launched_ahead(tiny_checkpoint, one_torch_thread):
    """A request added while a ramping answer's step is in flight is admitted into the step launched ahead (no launch
    after the tokens are read: neither it nor the ramping answer waits for the host), and both requests get the rows
    they get one step at a time. Past the ramp, a waiting request is admitted by a normal step, as before."""
    rows, _, _ = requests(5)["r1"]
    params = SamplingParams.greedy_params(max_new_tokens=20, min_new_tokens=20)  # audio to the end (make_engine)
    late_rows, _, _ = requests(6)["r2"]

    def drive(engine: Engine, join: dict[str, int]) -> tuple[dict[str, list], dict[str, bool]]:
        got: dict[str, list] = {"answer": [], "late": [], "past": []}
        ahead_with: dict[str, bool] = {}
        for step in range(200):
            for rid, at in join.items():
                if at == step:
                    engine.add_request(rid, late_rows if rid == "late" else rows, params)
            gaps = engine.stats().launch_gaps
            step_into(engine, got)
            for rid, at in join.items():
                if at == step:  # launched ahead with this request's prefill, and no launch after tokens were read
                    inflight = engine._inflight
                    ahead_with[rid] = (inflight is not None and engine.stats().launch_gaps == gaps
                                       and any(c.seq.request_id == rid for c in inflight.chunks))
            if not engine.has_work():
                break
        return got, ahead_with

    join = {"answer": 0, "late": 2, "past": 12}  # "late" during the answer's ramp, "past" after it
    plain, eng = make_engine(tiny_checkpoint, overlap=False), make_engine(tiny_checkpoint, overlap=True)
    ref, _ = drive(plain, join)
    got, ahead_with = drive(eng, join)
    assert got == ref
    assert eng.scheduler.config.ramp_rows < 12  # (the answers ramp for fewer steps than "past" waits)
    assert ahead_with == {"answer": True, "late": True, "past": False}
    eng.check_integrity()


def test_an_answer_ending_beside_a_ramping_one_leaves_the_step_launched_ahead(tiny_checkpoint, one_torch_thread):
    """An answer whose in-flight row is its last by length gets no row in the step launched ahead, instead of
    stopping the launch: a second answer ramping beside it never waits for the host's turn between steps. Both get
    the rows they get one step at a time. A text prompt still stops the launch, and says so in the stats."""
    ending_beside_ramping(tiny_checkpoint, "cpu")
