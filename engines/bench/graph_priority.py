"""Whose priority a CUDA graph's kernels run at: `python3 -m engines.bench.graph_priority` on a GPU.

The served batch-1 Euler solve graph of the `full-random` codec (a new answer's first chunk) is captured twice, on a
stream of the most urgent priority and on one of the least, and each capture is replayed on an urgent and on a low
stream, alone and beside a load replayed back to back on a low stream: GEMMs of 16 rows against distinct 117 MB bf16
weights (`engines.bench.sm_partition`'s load, captured at the least priority; HBM-bound, every SM busy for each
GEMM's length), a stand-in for the language model's steps or a playing round. Printed per case: ms per solve alone
(mean of back-to-back replays) and beside the load (p50, p90 of one-at-a-time replays). A graph's kernels keep their
capture stream's priority (engines.graphs.private_stream). It never changes clocks.
"""

from __future__ import annotations

import argparse

import torch

from engines.bench.sm_partition import load_graph, replay_on, solve_graph, under_load


def main() -> None:
    from engines.codec.decoder import CodecDecoder
    from engines.graphs import private_stream

    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="full-random")
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    dec = CodecDecoder.load(a.codec, device="cuda", vocoder="hift", cuda_graphs=True, estimator_dtype="bfloat16")
    load, _weights = load_graph(private_stream(urgent=False))
    solves = {f"captured {'urgent' if u else 'low'}": solve_graph(dec, a.batch, private_stream(), urgent=u)
              for u in (True, False)}
    replays = {"urgent": private_stream(urgent=True), "low": private_stream(urgent=False)}
    low = private_stream(urgent=False)
    for sname, (solve, _x, _owner) in solves.items():
        for rname, stream in replays.items():
            alone = replay_on(solve, stream, 20)
            print(f"solve {sname}, replayed on a {rname} stream: alone {alone:.2f} ms", flush=True)
            m, p90, lm, still = under_load(solve, load, 20, stream, low)
            print(f"  beside the gemm load: p50 {m:.2f} p90 {p90:.2f} ms (load {lm:.2f} ms a replay"
                  f"{'' if still else '; it ran out before the last solve: a lower bound'})", flush=True)


if __name__ == "__main__":
    main()
