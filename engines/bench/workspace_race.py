"""Two CUDA graphs replayed at the same time on two streams: results against eager references, with the graphs
captured on one shared stream (as every graph was captured on PyTorch pool streams before) or each on a private
stream (engines.graphs.private_stream). cuBLAS takes its workspace by (handle, stream), and a captured GEMM keeps
that address, so two graphs captured on one stream share a workspace; run at once, their split-K GEMMs can
overwrite each other's partial sums and semaphores.

    python -m engines.bench.workspace_race [--capture shared|private] [--rounds N] [--timeout S]

Prints one JSON line: rounds, mismatched outputs, the largest error, and whether the replays finished within the
timeout (a hang leaves the process stuck on the GPU: run it under `timeout`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from engines.graphs import capture_graph, private_stream

# Skinny GEMMs of the kinds that run beside each other in the server (decode batches of the language model,
# codec chunks): few output tiles over a long K, where cuBLAS splits K and reduces through its workspace.
SHAPES = ((56, 4096, 4096), (64, 1024, 14336), (64, 512, 16384), (128, 256, 8192))


def _owner(gen: torch.Generator, scale: float):
    """Inputs and weights of one graph owner: a chain of GEMMs over every shape."""
    mats = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * scale
        mats.append((x, w))
    return mats


def _run(mats) -> list[torch.Tensor]:
    return [F.linear(x, w) for x, w in mats]


def race(capture: str = "private", rounds: int = 300, timeout_s: float = 60.0) -> dict:
    """Replay the two owners' graphs `rounds` times at once; `capture`: "shared" (one capture stream) or
    "private" (one each). Returns what main prints."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    owners = [_owner(gen, 0.01), _owner(gen, 0.02)]
    refs = [_run(m) for m in owners]
    shared = private_stream()
    streams = [shared, shared] if capture == "shared" else [private_stream(), private_stream()]
    graphs = [capture_graph(lambda m=m: _run(m), s) for m, s in zip(owners, streams, strict=True)]
    torch.cuda.synchronize()
    # Replayed on two other streams, no order between them: the two owners' GEMMs overlap on the GPU.
    run_on = [torch.cuda.Stream(), torch.cuda.Stream()]
    bad, worst, finished, t0 = 0, 0.0, True, time.monotonic()
    for _ in range(rounds):
        for (g, _), s in zip(graphs, run_on, strict=True):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(4):
                    g.replay()
        for s in run_on:
            torch.cuda.current_stream().wait_stream(s)
        end = torch.cuda.Event()
        end.record()
        while finished and not end.query():
            finished = time.monotonic() - t0 < timeout_s
            time.sleep(0.001)
        if not finished:
            break
        for (_, outs), ref in zip(graphs, refs, strict=True):
            for o, r in zip(outs, ref, strict=True):
                err = (o.float() - r.float()).abs().max().item() / max(r.float().abs().max().item(), 1e-6)
                worst = max(worst, err)
                bad += err > 1e-2
    return {"capture": capture, "rounds": rounds, "mismatched_outputs": int(bad), "max_rel_error": worst,
            "finished": finished, "seconds": round(time.monotonic() - t0, 2), "device": torch.cuda.get_device_name()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capture", choices=("shared", "private"), default="private")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    print(json.dumps(race(args.capture, args.rounds, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
