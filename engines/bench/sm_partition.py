"""The codec's solve beside a saturating load, with and without SM partitions: `python3 -m engines.bench.sm_partition`.

The load stands in for the language model's decode steps: GEMMs of 16 rows against distinct 117 MB bf16 weights
(HBM-bound, every SM busy), one CUDA graph replayed back to back. The solve is the served batch-1 (and batch-8) Euler
solve graph of the `full-random` codec. Per `--sms` value N (engines.partition.split):
- "only": the solve captured in the codec's N SMs, the load in the other SMs (`--codec-sms N --codec-sms-only`);
- "reserve": the solve on every SM, the load in the other SMs (`--codec-sms N`).
Printed: ms per solve alone and under the load (p50, p90 of one-at-a-time replays) and ms per load replay. A
development tool for docs/PERF_NOTES.md; it never changes clocks.
"""

from __future__ import annotations

import argparse
import time

import torch

from engines.bench.hardware import replay_ms

LOAD_WEIGHTS = 24  # x 117 MB: far more than L2, so each replay streams ~2.8 GB from HBM


def load_graph(stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    from engines.graphs import capture_graph

    ws = [torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(LOAD_WEIGHTS)]
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    graph, _ = capture_graph(lambda: [x @ w.t() for w in ws], stream)
    return graph, ws


def solve_graph(dec, batch: int, stream: torch.cuda.Stream, urgent: bool = False):
    """The solve graph captured while `stream` is current (so in its partition), at the most urgent priority or the
    least. Returns (graph, mel, owner)."""
    from engines.codec.decoder.graphs import EulerGraphs

    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.cuda.stream(stream), torch.inference_mode():
        graphs = EulerGraphs(dec.flow, urgent)
        inputs = [torch.randn(s, device="cuda", dtype=dec.flow.dtype, generator=gen)
                  for s in graphs.input_shapes(batch)]
        x, _ = graphs.run(*inputs)
    torch.cuda.synchronize()
    return next(iter(graphs.graphs.values()))[0], x, graphs


def replay_on(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, reps: int) -> float:
    with torch.cuda.stream(stream):
        return replay_ms(graph, reps)


def under_load(solve: torch.cuda.CUDAGraph, load: torch.cuda.CUDAGraph, reps: int = 30,
               solve_stream: torch.cuda.Stream | None = None, load_stream: torch.cuda.Stream | None = None
               ) -> tuple[float, float, float, bool]:
    """Solves one at a time (each timed by events) on `solve_stream` while the load replays back to back on
    `load_stream` (defaults: a pool stream, and one of the most urgent priority): p50 and p90 ms per solve, ms per
    load replay, and whether the load still ran when the last solve ended."""
    lo = solve_stream if solve_stream is not None else torch.cuda.Stream()
    hi = load_stream if load_stream is not None else torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    n_load = int(8 * reps * replay_on(solve, lo, 5) / replay_on(load, hi, 5)) + 10
    torch.cuda.synchronize()
    ls, le = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(hi):
        ls.record()
        for _ in range(n_load):
            load.replay()
        le.record()
    time.sleep(0.05)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(lo):
            s.record()
            solve.replay()
            e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    still = not le.query()
    le.synchronize()
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.9)], ls.elapsed_time(le) / n_load, still


def main() -> None:
    from engines.codec.decoder import CodecDecoder
    from engines.graphs import private_stream
    from engines.partition import split

    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="full-random")
    p.add_argument("--sms", default="16,32,48,72", help="codec SM counts to split off")
    p.add_argument("--batches", default="1,8")
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs, "
          f"torch {torch.__version__}")
    dec = CodecDecoder.load(a.codec, device="cuda", vocoder="hift", cuda_graphs=True, estimator_dtype="bfloat16")
    splits = [split("cuda", int(n)) for n in a.sms.split(",")]
    base_load, _w = load_graph(private_stream())
    print(f"load alone, every SM: {replay_on(base_load, torch.cuda.Stream(), 20):.3f} ms per replay")
    for batch in [int(b) for b in a.batches.split(",")]:
        solve, want, _keep = solve_graph(dec, batch, private_stream())
        print(f"\nbatch {batch}: solve alone, every SM: {replay_on(solve, torch.cuda.Stream(), 20):.3f} ms")
        m, p90, lm, still = under_load(solve, base_load)
        print(f"  shared (no partition): solve p50 {m:.2f} p90 {p90:.2f} ms, load {lm:.3f} ms "
              f"(load outlasted: {still})")
        for sp in splits:
            load, _wl = load_graph(sp.stream("lm"))
            only, got, _keep2 = solve_graph(dec, batch, sp.stream("codec"))
            diff = float((got.float() - want.float()).abs().max())
            alone, load_alone = replay_on(only, torch.cuda.Stream(), 20), replay_on(load, torch.cuda.Stream(), 20)
            print(f"  {sp.codec_sms} codec SMs / {sp.lm_sms} load SMs: load alone {load_alone:.3f} ms; solve on its "
                  f"SMs only alone {alone:.3f} ms (max diff {diff:.1e})")
            for name, g in (("only", only), ("reserve", solve)):
                m, p90, lm, still = under_load(g, load)
                print(f"    {name:7s} under load: solve p50 {m:.2f} p90 {p90:.2f} ms, load {lm:.3f} ms ({still})",
                      flush=True)
            del load, _wl
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
