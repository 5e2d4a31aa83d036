"""Where a speech-encoder step's time goes: host (cProfile, by function) and device (torch.profiler, by kernel).

    python3 -m engines.profiling.profile_encoder [--codec full-random] [--batch 1] [--piece-ms 80] [--graphs] [--tf32]

Pushes `--context-s` of audio per stream first, then profiles `--steps` steps of `--piece-ms` each and prints the
median wall time of a step (synchronised), the host's top functions and the GPU kernels summed by name.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch

from engines.speech_in import SpeechEncoder
from moss_speech.commands.bench_encoder import warm_streams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="full-random")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--piece-ms", type=int, default=80)
    p.add_argument("--context-s", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--tf32", action="store_true", help="float32 products on TF32 (the engine's --encoder-tf32)")
    args = p.parse_args()
    enc = SpeechEncoder.load(args.codec, device="cuda", tf32=args.tf32)
    enc.reserve(args.batch)
    if args.graphs:
        enc.capture_graphs()
    step, _ = warm_streams(enc, args.batch, args.piece_ms, args.context_s, np.random.default_rng(0))
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    print(f"batch {args.batch}, {args.piece_ms} ms pieces, graphs {args.graphs}, tf32 {args.tf32}: step median "
          f"{1e3 * float(np.median(walls)):.2f} ms (min {1e3 * min(walls):.2f})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-4000:])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
