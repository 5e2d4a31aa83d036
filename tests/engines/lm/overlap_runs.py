"""Runs of the engine with and without overlapped decode that the CPU and GPU tests share: an engine whose answers
leave audio mode as early as allowed, requests joining at random steps, and a step-by-step driver that checks the
KV books after each step."""

from __future__ import annotations

import random

import torch

from engines.api import ChannelSampling, SamplingParams
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.lm.loader.checkpoint import load_model
from engines.tokens import AUDIO_PAD, EOSP, IM_END, IM_START, SOSP, text_rows


def make_engine(ckpt, overlap: bool, device: str = "cpu", cuda_graphs: bool = True) -> Engine:
    model = load_model(ckpt, device=device)
    mc = model.config
    # Make eosp the likeliest audio code, so each answer leaves audio mode right when min_new_tokens allows
    # it: sequences switch modes at different steps while the others keep decoding audio.
    orig = model.audio_logits
    bias = torch.zeros(mc.audio_vocab_size, device=device)
    bias[EOSP] = 60.0
    model.audio_logits = lambda h: orig(h) + bias
    cfg = EngineConfig(block_size=4, kv_cache_bytes=mc.kv_bytes_per_row() * 2048, max_running=6,
                       prefill_token_budget=40, overlap=overlap, device=device, cuda_graphs=cuda_graphs)
    return Engine(model, mc, cfg)


def requests(seed: int) -> dict[str, tuple[list, SamplingParams, int]]:
    rng = random.Random(seed)
    out = {}
    for i in range(7):
        rows = text_rows([IM_START] + [rng.randrange(200, 150000) for _ in range(rng.randint(2, 12))] + [IM_END])
        rows += text_rows([IM_START, rng.randrange(200, 150000)]) + [(SOSP, AUDIO_PAD)]
        max_new = rng.randint(6, 30)
        min_new = rng.randint(2, max_new - 3)
        if i % 2:
            params = SamplingParams.greedy_params(max_new_tokens=max_new, min_new_tokens=min_new)
        else:
            ch = ChannelSampling(temperature=0.9, top_k=40)
            params = SamplingParams(text=ch, audio=ch, max_new_tokens=max_new, min_new_tokens=min_new, seed=100 + i)
        out[f"r{i}"] = (rows, params, rng.randint(0, 25))  # joins at that step
    return out


def step_into(engine: Engine, got: dict[str, list]) -> None:
    """One engine step: its rows go to their requests' lists; the KV books must balance after it."""
    for o in engine.step():
        got[o.request_id].append((o.text_token, o.audio_token, o.mode, o.finish_reason))
    engine.check_integrity()


def run(engine: Engine, reqs, abort_at: dict[str, int] | None = None) -> dict[str, list]:
    got: dict[str, list] = {rid: [] for rid in reqs}
    step = 0
    while step < 400 and (step <= 25 or engine.has_work()):
        for rid, (rows, params, at) in reqs.items():
            if at == step:
                engine.add_request(rid, rows, params, conversation_id=f"c-{rid}")
        for rid, at in (abort_at or {}).items():
            if at == step:
                engine.abort(rid)
        step_into(engine, got)
        step += 1
    assert not engine.has_work()
    return got


def ending_beside_ramping(tiny_checkpoint, device: str) -> None:
    """An answer ending beside a ramping one leaves the step launched ahead (test_engine_overlap.py states it; the
    GPU suite runs it in the decode graphs)."""
    rows, _, _ = requests(5)["r1"]
    short = SamplingParams.greedy_params(max_new_tokens=6, min_new_tokens=6)  # audio to the end (make_engine)
    long = SamplingParams.greedy_params(max_new_tokens=20, min_new_tokens=20)

    def drive(engine: Engine) -> tuple[dict[str, list], list[int]]:
        got: dict[str, list] = {"short": [], "long": []}
        gaps_while_ramping = []
        for step in range(100):
            if step == 0:
                engine.add_request("short", rows, short)
            if step == 3:
                engine.add_request("long", rows, long)
            gaps = engine.stats().launch_gaps
            step_into(engine, got)
            if 0 < len(got["long"]) < engine.config.ramp_rows:
                gaps_while_ramping.append(engine.stats().launch_gaps - gaps)
            if not engine.has_work():
                break
        return got, gaps_while_ramping

    plain = make_engine(tiny_checkpoint, overlap=False, device=device, cuda_graphs=False)
    eng = make_engine(tiny_checkpoint, overlap=True, device=device)
    assert device == "cpu" or eng.runner.graphs is not None
    ref, _ = drive(plain)
    got, gaps = drive(eng)
    assert got == ref
    assert len(ref["short"]) == 6 and len(ref["long"]) == 20
    # "short" ended while "long" ramped (its 6 rows from step 1, "long"'s from step 4 or 5)
    assert len(gaps) >= 5 and sum(gaps) == 0, gaps
    assert eng.stats().ahead_refused_ramping == {}
    eng.check_integrity()

    text_prompt = rows[:-1] + text_rows([IM_END])
    eng.add_request("text", text_prompt, long)
    eng.step()
    assert eng._inflight is None and eng.stats().ahead_refused_ramping == {"text prompt": 1}
    eng.abort("text")
    while eng.has_work():
        eng.step()
    eng.check_integrity()
