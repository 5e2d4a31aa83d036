"""`moss-speech bench encoder`: speech-encoder time per 80 ms of audio at several batch sizes.

Each timed step pushes one 80 ms piece (one code) for every stream of the batch through the
batched encoder step, after a warm-up long enough that the streams carry a few seconds of context.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from engines.bench.hardware import device_name, median, timed
from engines.codec.encoder import SpeechEncoder

PIECE = 1280  # 80 ms at 16 kHz


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="tiny-random")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context-s", type=float, default=4.0, help="audio pushed before timing")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    enc = SpeechEncoder.load(args.codec, device=device, dtype=args.dtype)
    rng = np.random.default_rng(0)
    res = {"device": device_name(device), "codec": args.codec, "dtype": args.dtype, "ms_per_80ms": {}}
    for b in [int(x) for x in args.batches.split(",")]:
        enc.reserve(b)
        streams = [enc.open_stream() for _ in range(b)]
        batch = enc.batch()

        def step(streams=streams, batch=batch):
            batch.step([(s, (0.1 * rng.standard_normal(PIECE)).astype(np.float32)) for s in streams])
        for _ in range(int(args.context_s * 16000 / PIECE)):
            step()
        t = median(timed(step, device, repeats=args.iters, warmup=1)) * 1e3
        res["ms_per_80ms"][str(b)] = t
        print(f"encoder batch {b:3d}: {t:.2f} ms per 80 ms step ({t / b:.3f} ms per stream)")
        for s in streams:
            s.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
