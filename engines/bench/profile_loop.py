"""Where a loop of decode steps spends its time: `python3 -m engines.bench.profile_loop --batches 1,64` on a GPU.

Per batch size: the step time of a loop of engine steps, the GPU's busy and idle time in that loop (kernel spans
from the torch profiler; idle = no kernel or copy running), the host functions that cost the most (cProfile of the
same loop), and optionally a chrome trace. A development tool for docs/PERF_NOTES.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engines.commands.bench_engine import _drain, add_decode_batch_arguments, decode_batch_config, start_decode_batch
from engines.engine import Engine


def gpu_busy(prof) -> tuple[float, float, int]:
    """(busy ms, span ms, gaps over 20 us) of the device activity (kernels, copies, sets) in a profile."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, gaps, end = 0.0, 0, None
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            gaps += end is not None and s - end > 20
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy / 1e3, (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0, gaps


def main() -> None:
    p = argparse.ArgumentParser()
    add_decode_batch_arguments(p, steps=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--trace", default=None, help="write a chrome trace per batch size into this folder")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    n = 4 * a.steps + 64
    engine = Engine.from_name(a.model, decode_batch_config(a.model, max(batches), a.context, n, a.device))
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    rng = random.Random(0)
    for b in batches:
        start_decode_batch(engine, rng, b, a.context, n)
        for _ in range(5):
            engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        sync()
        step_ms = (time.perf_counter() - t0) / a.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                engine.step()
            sync()
        busy, span, gaps = gpu_busy(prof)
        print(f"\n=== batch {b}: loop {step_ms:.3f} ms/step; under the profiler GPU busy {busy / a.steps:.3f} ms/step "
              f"of {span / a.steps:.3f} ms/step ({gaps} gaps > 20 us)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        if a.trace:
            prof.export_chrome_trace(f"{a.trace}/loop-b{b}.json")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            engine.step()
        sync()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(s.getvalue().splitlines()[:40]))
        _drain(engine)


if __name__ == "__main__":
    main()
