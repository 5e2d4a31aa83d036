"""What the parity tests of the paged engine share: the tiny engine, mixed prompts of the four kinds, greedy runs,
and the judge that its rows follow a dense reference's greedy rows (near-ties either way)."""

from __future__ import annotations

import random

from engines.api import SamplingParams
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.lm.loader.checkpoint import load_model
from engines.tokens import AUDIO_PAD, IM_END, IM_START, SOSP, audio_span_rows, text_rows
from tests.reference.dense_generate import FP32_MARGIN, check_follows_greedy

STEPS = 64


def make_engine(ckpt, block_size: int, **kw) -> Engine:
    model = load_model(ckpt, device="cpu")
    mc = model.config
    cfg = EngineConfig(block_size=block_size, kv_cache_bytes=mc.kv_bytes_per_row() * 4096, **kw)
    return Engine(model, mc, cfg)


def make_prompt(rng: random.Random, kind: str) -> list[tuple[int, int]]:
    rows = text_rows([IM_START] + [rng.randrange(200, 150000) for _ in range(rng.randint(2, 20))] + [IM_END])
    if kind in ("audio_in", "audio_in_audio_out"):
        rows += audio_span_rows([rng.randrange(0, 16384) for _ in range(rng.randint(3, 25))])
    rows += text_rows([IM_START, rng.randrange(200, 150000)])
    if kind.endswith("audio_out"):
        rows.append((SOSP, AUDIO_PAD))  # spoken answer: the prefix ends in sosp
    return rows


def greedy(n=STEPS, min_new=0):
    return SamplingParams.greedy_params(max_new_tokens=n, min_new_tokens=min_new)


def run_mixed_greedy(engine: Engine, seed: int) -> tuple[dict[str, list], dict[str, list]]:
    """Eight requests of the four prompt kinds added at once and run greedily to the end, the KV checked each step:
    (prompts, emitted (text, audio, mode) rows) by request id."""
    rng = random.Random(seed)
    kinds = ["text", "audio_in", "audio_out", "audio_in_audio_out"]
    reqs = {f"r{i}": make_prompt(rng, kinds[i % 4]) for i in range(8)}
    got: dict[str, list] = {rid: [] for rid in reqs}
    for rid, rows in reqs.items():
        engine.add_request(rid, rows, greedy())
    while engine.has_work():
        for o in engine.step():
            got[o.request_id].append((o.text_token, o.audio_token, o.mode))
        engine.check_integrity()
    return reqs, got


def assert_follows(reference, rows: list, got: list, steps: int = STEPS, min_new: int = 0,
                   margin: float = FP32_MARGIN) -> None:
    """The engine's greedy rows are the dense reference's, near-ties (logits within `margin`) either way."""
    verdict = check_follows_greedy(reference, rows, got, steps, min_new_tokens=min_new, margin=margin)
    assert verdict.follows, verdict.wrong


def assert_follows_reference(engine: Engine, reqs: dict[str, list], got: dict[str, list], reference, plain,
                             margin: float = FP32_MARGIN) -> None:
    """The engine's rows are the `reference` dense model's greedy rows on every request, not the `plain` one's on
    some (so the test sees the numerics the reference models), and every KV block went back to the pool."""
    for rid, rows in reqs.items():
        assert_follows(reference, rows, got[rid], margin=margin)
    assert not all(check_follows_greedy(plain, rows, got[rid], STEPS, margin=margin).follows
                   for rid, rows in reqs.items())
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
