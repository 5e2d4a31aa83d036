"""Decode-step variants on one engine: `python3 -m engines.profiling.decode_ab --model full-random` on a GPU.

Each variant (e.g. `pdl=1,attn_preload=0,tails=0`) sets programmatic dependent launch (engines/kernels/pdl.py) and
the two tails side by side (engines/lm/model/moss.py) on or off (each on unless given), the decode attention's preload
limit and its split counts and tilings (`attn=0`: as served until 2026-11-27, engines/kernels/lm/paged_decode.py), and
recaptures the decode graphs; each then times the graph replay alone and a loop of engine steps (each may launch the
next before reading its tokens) at each batch size. Variants alternate over several rounds, so drift of the machine
shows as spread, not as a difference.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from engines.bench.hardware import device_name, measure_bandwidth, median, timed
from engines.kernels import pdl
from engines.kernels.lm import paged_decode, skinny_gemm
from engines.lm.engine import Engine
from moss_speech.commands.bench_engine import (
    _drain,
    add_decode_batch_arguments,
    decode_batch_config,
    start_decode_batch,
    weight_bytes,
)

# The decode attention served until 2026-11-27 (`attn=0`): two programs an SM, 64-row tiles at every split count, the
# merge after one split too.
_ATTN_OLD = {"PROGRAMS_PER_SM": 2, "TILING_MANY_SPLITS": (64, 4, 2), "TILING_WIDE": (64, 4, 2),
             "MERGE_ONE_SPLIT": True}


def _variant(spec: str) -> dict:
    """'pdl=1' -> {'pdl': 1}."""
    return {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}


def main() -> None:
    p = argparse.ArgumentParser()
    add_decode_batch_arguments(p, steps=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=["pdl=0", "pdl=1"])
    p.add_argument("--fp8-weights", action="store_true", help="EngineConfig.fp8_weights")
    p.add_argument("--fp8-only", action="store_true", help="EngineConfig.fp8_only (with --fp8-weights)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    batches = a.batches
    rounds_steps = a.rounds * len(a.variants) * (a.steps + 24) + 64
    engine = Engine.from_name(a.model, decode_batch_config(a.model, max(batches), a.context, rounds_steps,
                                                             fp8_weights=a.fp8_weights, fp8_only=a.fp8_only))
    bw = measure_bandwidth(dev, 2 << 30)
    floor_ms = weight_bytes(engine.runner.model, False) / bw * 1e3
    print(f"device: {device_name(dev)}  copy bandwidth {bw / 1e12:.2f} TB/s  weights-only floor {floor_ms:.2f} ms")
    rng = random.Random(0)
    graphs = engine.runner.graphs
    tail_stream = engine.runner.model.tail_stream
    idx = torch.cuda.current_device()
    attn_new = {k: getattr(paged_decode, k) for k in _ATTN_OLD}
    res: dict = {"device": device_name(dev), "bandwidth": bw, "floor_weights_ms": floor_ms, "results": {}}
    for b in batches:
        start_decode_batch(engine, rng, b, a.context, rounds_steps)
        for r in range(a.rounds):
            for spec in a.variants:
                v = _variant(spec)
                pdl._enabled[idx] = bool(v.get("pdl", 1))
                # decode attention's first tile read before the PDL wait up to this many programs (0: never;
                # default: the SM count)
                paged_decode.PRELOAD_MAX_PROGRAMS = v.get("attn_preload")
                for k, new in attn_new.items():  # the split counts and tilings of a bf16 cache
                    setattr(paged_decode, k, new if v.get("attn", 1) else _ATTN_OLD[k])
                # the text tail beside the audio tail (engines/lm/model/moss.py), or after it
                engine.runner.model.tail_stream = tail_stream if v.get("tails", 1) else None
                torch.cuda.synchronize()  # the step in flight is done (its tokens wait on the host) before its
                graphs.capture()  # graphs and their outputs are replaced
                engine.step()  # the static buffers hold a real batch again (capture leaves padding there)
                replay = median(timed(graphs.graphs[graphs.bucket(b)].replay, dev, repeats=20)) * 1e3
                loop = timed(lambda: [engine.step() for _ in range(a.steps)], dev, repeats=1, warmup=0)[0]
                loop_ms = loop / a.steps * 1e3
                out = res["results"].setdefault(f"b{b} {spec}", {"replay_ms": [], "step_ms": []})
                out["replay_ms"].append(replay)
                out["step_ms"].append(loop_ms)
                print(f"round {r} batch {b:3d} {spec:24s} replay {replay:6.3f} ms  step {loop_ms:6.3f} ms")
        _drain(engine)
    print(f"\nmedians (weights-only floor {floor_ms:.2f} ms at batch 1):")
    for key, out in res["results"].items():
        print(f"  {key:34s} replay {median(out['replay_ms']):6.3f}  step {median(out['step_ms']):6.3f} ms")
    engine.check_integrity()
    for key, t in skinny_gemm.timings.items():
        best = min((c for c in t if c != "cublas"), key=t.__getitem__)
        cublas = f"{t['cublas'] * 1e6:.1f} us" if "cublas" in t else "-"
        print(f"  skinny {key[0]:6d} x {key[1]:5d} {key[2]} (tile {key[3]}): chosen {skinny_gemm._choice[key]}, "
              f"cuBLAS {cublas}, best tiling {best} {t[best] * 1e6:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
