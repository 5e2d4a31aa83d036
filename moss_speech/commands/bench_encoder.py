"""`moss-speech bench encoder`: speech-encoder time per step of audio at several batch sizes.

Each timed step pushes one piece (default 80 ms: one code) for every stream of the batch through the
batched encoder step, after a warm-up long enough that the streams carry a few seconds of context.
`--graphs` replays the blocks of steps of up to 8 streams as CUDA graphs (as the server does).
`--held` steps as the server's calls of held audio do (the encoder's lowest-priority stream); `--gil-busy` times
them beside a thread that runs Python all the time with the server's 0.5 ms switch interval, as the engine loop
and the codec's thread compete with the encoder's thread for the GIL under load.
Each batch also prints what a step's wall time was made of, as the server's load log splits its encoder calls: the
calling thread's CPU time and the step's wait for the GPU (an event wait that spins counts in both; what is left of
the wall went waiting for the GIL).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from engines.bench.hardware import device_name, median, sync
from engines.speech_in import SpeechEncoder
from moss_speech.commands.arguments import counts, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="tiny-random")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=counts, default="1,64")
    p.add_argument("--context-s", type=float, default=4.0, help="audio pushed before timing")
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--piece-ms", type=int, default=80, help="audio per stream per timed step")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs for steps of up to 8 streams")
    p.add_argument("--tf32", action="store_true", help="float32 products on TF32 (the engine's --encoder-tf32)")
    p.add_argument("--held", action="store_true", help="steps on the lowest-priority stream, as held audio's")
    p.add_argument("--gil-busy", action="store_true", help="a thread running Python beside the timed steps")
    p.add_argument("--json", default=None)


def warm_streams(enc: SpeechEncoder, batch: int, piece_ms: int, context_s: float, rng: np.random.Generator,
                 urgent: bool = True) -> tuple[Callable[[], None], list]:
    """`batch` streams carrying `context_s` of noise-like audio, and a step that pushes `piece_ms` more into each
    (one batched call). Returns (step, streams); the caller closes the streams."""
    piece = 16 * piece_ms  # 16 kHz
    streams = [enc.open_stream() for _ in range(batch)]
    calls = enc.batch(urgent)
    noise = [(0.1 * rng.standard_normal(piece)).astype(np.float32) for _ in range(7)]  # made outside the timing

    turns = itertools.count()

    def step() -> None:
        k = next(turns)
        calls.step([(s, noise[(i + k) % len(noise)]) for i, s in enumerate(streams)])
    for _ in range(int(context_s * 1000 / piece_ms)):
        step()
    return step, streams


@contextlib.contextmanager
def gil_busy(on: bool):
    """A daemon thread running Python (never releasing the GIL by itself) while inside, at a 0.5 ms switch
    interval."""
    if not on:
        yield
        return
    stop, before = threading.Event(), sys.getswitchinterval()
    sys.setswitchinterval(0.0005)

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(before)


def step_times(enc: SpeechEncoder, step: Callable[[], None], device: torch.device, repeats: int
               ) -> tuple[float, float, float]:
    """Medians over `repeats` steps (after one more), in ms: each step's wall time, the calling thread's CPU time and
    its GPU wait (`SpeechEncoder.last_gpu_wait_s`; a step that yields codes ends with its wait for them, so the CPU
    time is read before the device sync that closes the wall time)."""
    step()
    sync(device)
    wall, cpu, wait = [], [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        cpu.append(time.thread_time() - c0)
        wait.append(enc.last_gpu_wait_s)
        sync(device)
        wall.append(time.perf_counter() - t0)
    return median(wall) * 1e3, median(cpu) * 1e3, median(wait) * 1e3


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    try:
        enc = SpeechEncoder.load(args.codec, device=device, dtype=args.dtype, tf32=args.tf32)
    except ValueError as e:  # --tf32 without float32 on CUDA
        raise SystemExit(str(e)) from None
    rng = np.random.default_rng(0)
    batches = args.batches
    enc.reserve(max(batches))  # before the graphs: a growth of the KV pool retires them
    res = {"device": device_name(device), "codec": args.codec, "dtype": args.dtype, "tf32": args.tf32,
           "piece_ms": args.piece_ms, "held": args.held, "gil_busy": args.gil_busy, "graphs": 0,
           f"ms_per_{args.piece_ms}ms": {}, "cpu_ms": {}, "gpu_wait_ms": {}}
    if args.graphs:
        t0 = time.perf_counter()
        res["graphs"] = enc.capture_graphs()
        print(f"{res['graphs']} step graphs captured in {time.perf_counter() - t0:.1f} s")
    for b in batches:
        step, streams = warm_streams(enc, b, args.piece_ms, args.context_s, rng, urgent=not args.held)
        with gil_busy(args.gil_busy):
            t, cpu, gpu_wait = step_times(enc, step, device, args.iters)
        res[f"ms_per_{args.piece_ms}ms"][str(b)] = t
        res["cpu_ms"][str(b)], res["gpu_wait_ms"][str(b)] = cpu, gpu_wait
        print(f"encoder batch {b:3d}: {t:.2f} ms per {args.piece_ms} ms step ({t / b:.3f} ms per stream); "
              f"its thread's CPU {cpu:.2f} ms, GPU wait {gpu_wait:.2f} ms")
        for s in streams:
            s.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
