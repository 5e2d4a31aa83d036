"""Where a loop of decode steps spends its time: `python3 -m engines.profiling.profile_loop --batches 1,64` on a GPU.

Per batch size: the step time of a loop of engine steps, the GPU's busy and idle time in that loop (kernel spans
from the torch profiler; idle = no kernel or copy running), the host functions that cost the most (cProfile of the
same loop), and optionally a chrome trace.
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

from engines.lm.engine import Engine
from moss_speech.commands.bench_engine import (
    _drain,
    add_decode_batch_arguments,
    decode_batch_config,
    start_decode_batch,
)


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


def launch_timeline(prof, last: int) -> list[str]:
    """The device work of the profile's last `last` host launches, one line per launch (a graph replay's kernels
    are one launch): start offset, device span and the idle gap before it, in microseconds."""
    events = list(prof.profiler.kineto_results.events())
    host = {e.correlation_id(): e.name() for e in events if e.device_type() == torch.autograd.DeviceType.CPU}
    groups: dict[int, list] = {}
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            g = groups.setdefault(e.correlation_id(), [e.start_ns(), e.start_ns() + e.duration_ns(), 0, e.name()])
            g[0], g[1], g[2] = min(g[0], e.start_ns()), max(g[1], e.start_ns() + e.duration_ns()), g[2] + 1
    spans = sorted(groups.items(), key=lambda kv: kv[1][0])[-last:]
    lines, t0, end = [], spans[0][1][0] if spans else 0, None
    for cid, (s, e, n, name) in spans:
        gap = 0.0 if end is None else (s - end) / 1e3
        lines.append(f"{(s - t0) / 1e3:9.1f} {(e - s) / 1e3:8.1f} gap {gap:6.1f}  {host.get(cid, '?')[:24]:24s} "
                     f"{n:4d} x {name[:60]}")
        end = e if end is None else max(end, e)
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    add_decode_batch_arguments(p, steps=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeline", type=int, default=60, help="list the device work of this many last launches")
    p.add_argument("--trace", default=None, help="write a chrome trace per batch size into this folder")
    a = p.parse_args()
    batches = a.batches
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
        print("\n".join(["launches of the last steps: start, span, gap (us), host call, kernels"]
                        + launch_timeline(prof, a.timeline)))
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
