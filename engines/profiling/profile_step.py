"""Where a step's time goes: `python3 -m engines.profiling.profile_step --model full-random` on a GPU.

Prints the split between the captured graph, the host work around it, and a prefill step's kernels.
`--ncu` instead replays the decode step's graph once between cudaProfilerStart and Stop, for Nsight Compute to time
each kernel node (torch.profiler's kernel lists of graph replays did not add up on torch 2.11):
`docs/bench/gpu_step_ncu.sh` runs it and sums the kernels by name and launch grid.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

import torch
from torch.profiler import ProfilerActivity, profile

from engines.bench.hardware import median, timed
from engines.lm.engine import Engine
from moss_speech.commands.bench_engine import _audio_forever, _drain, _rows, decode_batch_config, start_decode_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="full-random")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--fp8-weights", action="store_true", help="EngineConfig.fp8_weights (decode reads fp8 copies)")
    p.add_argument("--fp8-only", action="store_true", help="EngineConfig.fp8_only (with --fp8-weights)")
    p.add_argument("--ncu", action="store_true", help="only the decode graph: timed, then one replay in a profiler "
                   "range (run under `ncu --profile-from-start off --graph-profiling node`)")
    a = p.parse_args()
    dev = torch.device("cuda")
    # Answers generate until the batch decodes: while it prefills (at most 64 rows a step while answers ramp) the first
    # admitted decode every step, so each needs an output budget of ~batch x context / 64 rows (with 200, 20 of 64
    # had finished before the last began), and the KV pool all those budgets (the scheduler reserves them).
    new_rows = a.batch * a.context // 64 + 256
    cfg = dataclasses.replace(decode_batch_config(a.model, max(64, a.batch), max(a.context, 512), new_rows),
                              fp8_weights=a.fp8_weights, fp8_only=a.fp8_only)
    engine = Engine.from_name(a.model, cfg)
    rng = random.Random(0)
    if a.ncu:
        _ncu_replay(engine, rng, a.batch, a.context, dev)
        return

    # Prefill of 512 rows: the model alone, then the whole engine step, then its kernels.
    def prefill_step():
        engine.add_request("p", _rows(rng, 512), _audio_forever(8))
        engine.step()
    prefill_step()
    _drain(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_step()
        torch.cuda.synchronize()
    _drain(engine)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))

    _decode_batch(engine, rng, a.batch, a.context, dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def _decode_batch(engine: Engine, rng: random.Random, batch: int, context: int, dev: torch.device
                  ) -> torch.cuda.CUDAGraph:
    """A decode batch of `batch` sequences at `context` rows, its graph's replay and the whole step timed and
    printed. Returns the graph."""
    start_decode_batch(engine, rng, batch, context, engine.config.max_model_len - context - 128)
    # The graph replayed below must be the bucket of the decode step staged last (the decode graphs read their inputs
    # from one buffer in their own layout: a 64-row replay over a 44-row step's words indexed out of bounds), and the
    # steps that brought the batch to decoding may have been mixed ones: one decode step first.
    engine.step()
    running = len(engine.scheduler.running)
    if running != batch:
        raise RuntimeError(f"decode batch {batch}: {running} sequences running")
    b = engine.runner.graphs.bucket(batch)
    graph = engine.runner.graphs.graphs[b]
    replay = median(timed(graph.replay, dev, repeats=20)) * 1e3
    step = median(timed(engine.step, dev, repeats=20)) * 1e3
    print(f"batch {batch} (graph of {b}), context {context}: graph replay {replay:.3f} ms, whole engine step "
          f"{step:.3f} ms", flush=True)
    return graph


def _ncu_replay(engine: Engine, rng: random.Random, batch: int, context: int, dev: torch.device) -> None:
    """_decode_batch, then one replay of its graph alone inside a profiler range."""
    graph = _decode_batch(engine, rng, batch, context, dev)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    graph.replay()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
