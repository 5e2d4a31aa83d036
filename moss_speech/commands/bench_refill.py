"""`moss-speech bench refill`: what re-prefilling a conversation cut to fit its context costs. A conversation's
history (default 6,000 rows) is prefilled again as background work (Scheduler) while other sessions' answers
decode: how long the re-prefill takes alone and beside them, and the decoding answers' step times (each step is one
row, 80 ms, of every playing answer) before and during it, p50 and p95."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from engines.api import SamplingParams
from engines.config import EngineConfig, model_config_for
from engines.lm.engine import Engine
from moss_speech.commands.bench_engine import _drain, _rows, decode_batch_config, start_decode_batch
from moss_speech.loadtest.stats import percentile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="full-random")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=6000, help="history rows prefilled again")
    p.add_argument("--sessions", type=int, default=64, help="other sessions' answers decoding meanwhile")
    p.add_argument("--context", type=int, default=1024, help="rows of each decoding answer's history")
    p.add_argument("--steps", type=int, default=100, help="decode steps timed before the re-prefill")
    p.add_argument("--json", default=None, help="write the results here")


def _step_ms(engine: Engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    if engine.config.device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _refill(engine: Engine, rng: random.Random, rows: int, name: str) -> tuple[float, list[float]]:
    """Adds a conversation turn whose first `rows` rows are history prefilled again; steps until they are in.
    Returns (ms until then, each step's ms meanwhile)."""
    engine.add_request(name, _rows(rng, rows + 8), SamplingParams(max_new_tokens=1), conversation_id=name,
                       refill_rows=rows)
    seq = engine.live_request(name)
    t0, steps = time.perf_counter(), []
    while seq.num_computed < rows:
        steps.append(_step_ms(engine))
    return (time.perf_counter() - t0) * 1e3, steps


def _new_rows(args: argparse.Namespace) -> int:
    """Each decoding answer's output budget: it decodes through the steps before and during the re-prefill."""
    return args.steps * 4 + args.rows


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The decoding answers, each with its whole output budget reserved, and the one conversation re-prefilled, in
    the pool (not every sequence at the re-prefill's size: at 64 sessions that asked for 124 GiB)."""
    new_rows = _new_rows(args)
    config = decode_batch_config(args.model, args.sessions + 1, args.context, new_rows, device=args.device)
    rows = args.sessions * (args.context + new_rows + 64) + args.rows + 16 + 64 + 4096
    return dataclasses.replace(config, prefill_token_budget=EngineConfig().prefill_token_budget,  # as served
                               max_model_len=max(config.max_model_len, args.rows + 16 + 128),
                               kv_cache_bytes=model_config_for(args.model).kv_bytes_per_row() * rows)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(0)
    engine = Engine.from_name(args.model, engine_config(args))
    # Warm-up, then the re-prefill alone.
    alone_ms, _ = _refill(engine, rng, min(args.rows, 512), "warm")
    _drain(engine)
    alone_ms, _ = _refill(engine, rng, args.rows, "alone")
    _drain(engine)
    start_decode_batch(engine, rng, args.sessions, args.context, _new_rows(args))
    before = [_step_ms(engine) for _ in range(args.steps)]
    loaded_ms, during = _refill(engine, rng, args.rows, "loaded")
    _drain(engine)
    out = {
        "model": args.model, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "rows": args.rows, "sessions": args.sessions, "context": args.context,
        "refill_alone_ms": round(alone_ms, 1), "refill_beside_answers_ms": round(loaded_ms, 1),
        "steps_during_refill": len(during),
        "answer_step_ms": {f"{when}_p{q}": None if (p := percentile(xs, q)) is None else round(p, 2)
                           for when, xs in (("before", before), ("during", during)) for q in (50, 95)},
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
