"""The skinny kernel over the model's decode weights (their fp8 copies, or `--weights bf16`) with 1, 2 or 4
accumulator chains a warp (`skinny_gemm.launch(chains=)`), against the copy rate: `python3 -m
engines.bench.skinny_chains [--rows 1,8,16] [--chains 1,2,4] [--tilings "32,256,4,5,1;32,512,4,3,1"] [--json OUT]`.

Why (docs/PERF_NOTES.md, session 42): with one program of 4 warps an SM (o, q/k/v on an H100) every MMA of a warp waits
for the one before, 256 in a row over K = 4096, and Nsight Compute shows those kernels issue-starved at 47-53% of the
DRAM rate. Each tiling is timed as the tuner times it (a CUDA graph of launches over weight copies past the L2); by
default the tiling the engine serves for the shape (`skinny_gemm.config_for`: the shipped pick, or tuned now). A
development tool for docs/PERF_NOTES.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from engines.bench.hardware import device_name, measure_bandwidth
from engines.bench.skinny_gemm import SHAPES
from engines.kernels import skinny_gemm
from engines.model.fp8 import quantize


def _tilings(spec: str) -> list[skinny_gemm.Config]:
    """'32,256,4,5,1;32,512,4,3,1' -> [(32, 256, 4, 5, 1), (32, 512, 4, 3, 1)]."""
    out = []
    for part in (p for p in spec.split(";") if p.strip()):
        cfg = tuple(int(v) for v in part.split(","))
        if len(cfg) != 5:
            raise SystemExit(f"a tiling is BLOCK_N,BLOCK_K,warps,stages,split_k; got {part!r}")
        out.append(cfg)
    return out


def _seconds(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None, cfg: skinny_gemm.Config, chains: int,
             copies: list[torch.Tensor]) -> float | None:
    """Seconds per call of one tiling with `chains` accumulators (None: it does not run on this GPU)."""
    return skinny_gemm.time_tilings(
        [cfg], lambda w, c: skinny_gemm.launch(x, w, c, out, scale=scale, chains=chains), copies, rounds=10).get(cfg)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16")
    p.add_argument("--chains", default="1,2,4")
    p.add_argument("--tilings", default="", help="tilings to time besides the served one, ';'-separated")
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    p.add_argument("--weights", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev, 1 << 30)
    print(f"{device_name(dev)}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    extra = _tilings(a.tilings)
    report = {"device": device_name(dev), "copy_bytes_per_s": bw, "rows": []}
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
        w, scale = quantize(w) if a.weights == "fp8" else (w, None)
        copies = skinny_gemm.weight_copies(w, scale)
        served = skinny_gemm.config_for(w, scale, torch.bfloat16, skinny_gemm.MAX_ROWS)
        if served is None:  # this bf16 shape goes to cuBLAS: time the tuner's best tiling instead
            key = (n, k, torch.bfloat16, skinny_gemm.MAX_ROWS)
            if key not in skinny_gemm.timings:  # (the choice came from a tuning file)
                skinny_gemm.tune(w)
            t = skinny_gemm.timings[key]
            served = min((c for c in t if c != "cublas"), key=t.__getitem__)
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            for cfg in [served, *extra]:
                for chains in (int(c) for c in a.chains.split(",")):
                    if cfg[1] % (16 * chains):
                        continue
                    t = _seconds(x, out, scale, cfg, chains, copies)
                    if t is None:
                        print(f"{name:8s} rows {rows:2d} {cfg} chains {chains}: does not run here", flush=True)
                        continue
                    nbytes = n * k * (1 if scale is not None else 2)
                    row = {"shape": name, "n": n, "k": k, "weights": a.weights, "rows": rows, "tiling": list(cfg),
                           "served": cfg == served, "chains": chains, "us": t * 1e6, "frac_of_copy_bw": nbytes / t / bw}
                    report["rows"].append(row)
                    print(f"{name:8s} rows {rows:2d} {cfg}{' (served)' if cfg == served else ''} chains {chains}: "
                          f"{t * 1e6:7.2f} us, {nbytes / t / 1e12:.2f} TB/s ({row['frac_of_copy_bw']:.0%} of copy)",
                          flush=True)
        del copies
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
