"""What a dependent stage costs: a kernel boundary under programmatic dependent launch, or a counter hand-off
inside one persistent kernel. `python3 -m engines.bench.handoff` on a GPU.

The codec estimator's solve is ~3,500 dependent stages of tiny work at batch 1 (docs/PERF_NOTES.md), so this one
number decides whether a persistent estimator kernel can pay (it did not: H200, docs/bench/handoff-h200.txt, and the
persistent transformer-stack kernel of the tenth session measured slower and was removed). Both variants run
the same N stages of P programs; each program reads a [16, WIDTH] bf16 tile that another program wrote in the stage
before, adds one and stores its own tile (float32, so the count stays exact):
- `chain`: one kernel per stage, N launches in a CUDA graph, each under PDL (wait, then trigger; as the codec's
  GEMM-like kernels);
- `persistent`: one launch; items (stage, program) are taken from an atomic ticket in stage order, and an item waits
  until every item of the stage before has published (acquire / release counters: the neighbour's tile), or in
  the `1-producer` variant only the item that wrote its own tile the stage before (most likely another program, so
  the tile still crosses SMs).
Prints microseconds per stage for each P, and checks every tile ends at N. `--cluster 8,16` also runs the stages
inside one thread-block cluster of that many blocks, ended by the cluster's barrier (engines/bench/cluster_handoff.py).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
import triton.language as tl

from engines.bench.hardware import replay_ms
from engines.graphs import capture_graph, private_stream
from engines.kernels.pdl import launch_kwargs, wait_then_trigger

WIDTH = 256  # a tile is [16, WIDTH]: one row block of the estimator's activations (float32 here)


@triton.jit
def _chain_stage(SRC, DST, P, WIDTH: tl.constexpr, PDL: tl.constexpr):
    wait_then_trigger(PDL)
    p = tl.program_id(0)
    offs = tl.arange(0, 16)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    x = tl.load(SRC + ((p + 1) % P) * 16 * WIDTH + offs)  # a neighbour's tile of the stage before
    tl.store(DST + p * 16 * WIDTH + offs, x + 1.0)


@triton.jit
def _persistent(BUF, CNT, N, P, WIDTH: tl.constexpr, ONE_PRODUCER: tl.constexpr):
    offs = tl.arange(0, 16)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    item = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")
    while item < N * P:
        s = item // P
        p = item % P
        # The tile read. A ping-pong of two buffers is safe for both: the one-producer item reads its own tile,
        # whose next writer waits for it; the others wait for the whole stage before writing again.
        src = p if ONE_PRODUCER else (p + 1) % P
        if s > 0:
            if ONE_PRODUCER:
                while tl.atomic_add(CNT + 1 + (s - 1) * P + src, 0, sem="acquire", scope="gpu") < 1:
                    pass
            else:
                while tl.atomic_add(CNT + 1 + N * P + (s - 1), 0, sem="acquire", scope="gpu") < P:
                    pass
        x = tl.load(BUF + ((s % 2) * P + src) * 16 * WIDTH + offs, cache_modifier=".cg")
        tl.store(BUF + (((s + 1) % 2) * P + p) * 16 * WIDTH + offs, x + 1.0)
        tl.debug_barrier()  # every thread's stores precede the release
        if ONE_PRODUCER:
            tl.atomic_add(CNT + 1 + s * P + p, 1, sem="release", scope="gpu")
        else:
            tl.atomic_add(CNT + 1 + N * P + s, 1, sem="release", scope="gpu")
        item = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")


def _time_graph(fn, reps: int) -> float:
    """ms per replay of a CUDA graph of fn (captured after warm-up runs: Triton compiles stay out of it)."""
    graph, _ = capture_graph(fn, private_stream())
    return replay_ms(graph, reps)


def _cell(name: str, fn, result: torch.Tensor, n: int, reps: int) -> str:
    """Microseconds per stage of `fn` (n stages, replayed from a graph), then one more run from `result` zeroed: every
    tile of it must end at n."""
    ms = _time_graph(fn, reps)
    result.zero_()
    fn()
    torch.cuda.synchronize()
    ok = bool((result.float() == n).all())
    return f"{name} {ms * 1000 / n:6.2f} us/stage{'' if ok else ' WRONG RESULT'}"


def chain(buf: torch.Tensor, n: int, p: int) -> None:
    """n stages as n kernels; buf [2, p, 16, WIDTH] (ping-pong), zeroed first."""
    buf.zero_()
    for s in range(n):
        _chain_stage[(p,)](buf[s % 2], buf[(s + 1) % 2], p, WIDTH=WIDTH, **launch_kwargs(buf.device))


def persistent(buf: torch.Tensor, n: int, p: int, programs: int, one_producer: bool) -> None:
    buf.zero_()
    cnt = torch.zeros(1 + n * p + n, device=buf.device, dtype=torch.int32)
    _persistent[(programs,)](buf, cnt, n, p, WIDTH=WIDTH, ONE_PRODUCER=one_producer, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=347, help="dependent stages (one estimator call: 347)")
    ap.add_argument("--programs", default="16,40,80,132", help="programs per stage")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cluster", default="", help="blocks per cluster for the cluster variants (e.g. 8,16; Hopper)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; {args.stages} stages of [16, {WIDTH}] float32 tiles")
    for p in (int(x) for x in args.programs.split(",")):
        buf = torch.empty(2, p, 16, WIDTH, device=dev, dtype=torch.float32)
        row = [f"P {p:4d}"]
        for name, fn in (("chain+PDL", partial(chain, buf, args.stages, p)),
                         ("persistent", partial(persistent, buf, args.stages, p, min(p, sms), False)),
                         ("persistent 1-producer", partial(persistent, buf, args.stages, p, min(p, sms), True))):
            row.append(_cell(name, fn, buf[args.stages % 2], args.stages, args.reps))
        print("  ".join(row), flush=True)
    for c in (int(x) for x in args.cluster.split(",") if x):
        from engines.bench.cluster_handoff import MODES, cluster_stages

        gbuf = torch.empty(2, c, 16, WIDTH, device=dev, dtype=torch.float32)
        out = torch.empty(c, 16, WIDTH, device=dev, dtype=torch.float32)
        row = [f"C {c:4d}"]
        for mode in MODES:
            row.append(_cell(f"cluster {mode}", partial(cluster_stages, gbuf, out, c, args.stages, mode), out,
                             args.stages, args.reps))
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
