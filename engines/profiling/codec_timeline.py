"""Where one codec step's time goes, host against GPU: `python3 -m engines.profiling.codec_timeline --codec full-random`
(a GPU; on a CPU the host marks only). Of the windowed flow (`--decoder-context window`).

Marks at the stages of a codec round as the server's codec worker runs it (engines/bench/codec_rounds.py), with no
synchronisation between them: a CUDA event on the current stream beside the host clock at every CUDA graph replay
and around the wait for a round's PCM, and host-clock marks around the host's steps (the job pick, the chunk
inputs, the prefix fills, the vocoder's windows, the crossfade). Printed as the median over steady-state steps of each
mark's host and GPU time since the step began: where a mark's GPU time is about its host time the GPU was waiting for
the host there.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from engines.bench.codec_rounds import SteadyRounds
from engines.bench.hardware import device_name
from engines.speech_out import CodecDecoder
from engines.speech_out.queued import QueuedRound

# The host steps marked: (what owns the function, as an attribute path from the decoder; the function).
HOST_STEPS = (("", "run_jobs"), ("flow", "decode_chunk"), ("flow", "_prefix_layouts"), ("flow", "_encode_in_place"),
              ("flow", "encode_inputs"), ("flow", "_index_arrays"), ("flow", "_write_state"), ("flow", "_solve"),
              ("flow.enc_graphs", "buffers"), ("windowed", "render"), ("windowed", "finish"))


class Timeline:
    """Marks (name, host seconds, CUDA event or None) of one step, and the patches that make them."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str, float, torch.cuda.Event | None]] = []
        self._undo: list[Callable[[], None]] = []

    def mark(self, name: str, gpu: bool = False) -> None:
        ev = None
        if gpu and self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.marks.append((name, time.perf_counter(), ev))

    def around(self, owner: object, attr: str, name: str, gpu: bool = False) -> None:
        """Mark `name>` before and `name<` after every call of owner.attr (an instance's attribute shadows its class's
        method for the run; a module's function is replaced), until `restore`."""
        if owner is None or not hasattr(owner, attr):
            return
        f = getattr(owner, attr)
        own = attr in vars(owner)  # else inherited (a class's method, a base's): removing ours uncovers it again
        before = vars(owner).get(attr)

        def wrapped(*a, **k):
            self.mark(name + ">", gpu)
            out = f(*a, **k)
            self.mark(name + "<", gpu)
            return out

        setattr(owner, attr, wrapped)
        self._undo.append((lambda: setattr(owner, attr, before)) if own else (lambda: delattr(owner, attr)))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def _owner(dec: CodecDecoder, path: str) -> object:
    obj = dec
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
    return obj


def timeline(dec: CodecDecoder, batch: int, steps: int, seed: int = 0) -> list[tuple[str, float, float]]:
    """(mark, median host ms, median GPU ms since the step's start; nan off CUDA) of `steps` steady-state steps of
    `batch` sessions, in the order the marks first came. The k-th mark of a name in a step is `name#k`."""
    cuda = dec.device.type == "cuda"
    rounds = SteadyRounds(dec, batch, seed)
    tl = Timeline(cuda)

    def step() -> list[tuple[str, float, float]]:
        rounds.feed()
        if cuda:
            torch.cuda.synchronize(dec.device)
        tl.marks.clear()
        tl.mark("start", gpu=True)
        rounds.decode()
        tl.mark("end", gpu=True)
        if cuda:
            torch.cuda.synchronize(dec.device)
        t0, e0 = tl.marks[0][1], tl.marks[0][2]
        return [(n, (h - t0) * 1e3, e0.elapsed_time(e) if e is not None and e0 is not None else math.nan)
                for n, h, e in tl.marks]

    for _ in range(dec.cfg.stream.steady_chunks + 2):  # until the encoder's window is full: the steady state
        step()
    try:
        for path, attr in HOST_STEPS:
            tl.around(_owner(dec, path), attr, attr)
        tl.around(QueuedRound, "wait", "pcm_wait", gpu=True)
        if cuda:
            tl.around(torch.cuda.CUDAGraph, "replay", "replay", gpu=True)
        rows = [step() for _ in range(steps)]
    finally:
        tl.restore()
        rounds.close()
    agg: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    order: list[str] = []
    for r in rows:
        seen: dict[str, int] = defaultdict(int)
        for n, h, g in r:
            k = f"{n}#{seen[n]}"
            seen[n] += 1
            if k not in agg:
                order.append(k)
            agg[k][0].append(h)
            agg[k][1].append(g)
    return [(k, statistics.median(agg[k][0]), statistics.median(agg[k][1])) for k in order]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", default="full-random")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocoder", default="hift", choices=["hift", "bigvgan"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--estimator-dtype", default="bfloat16")
    p.add_argument("--no-encoder-tf32", action="store_true", help="the flow encoder in IEEE float32 (the server: TF32)")
    a = p.parse_args()
    if a.batch < 1 or a.steps < 1:
        p.error("--batch and --steps must be >= 1")
    cuda = a.device.startswith("cuda")
    dec = CodecDecoder.load(a.codec, device=a.device, vocoder=a.vocoder, cuda_graphs=cuda,
                            estimator_dtype=a.estimator_dtype, encoder_tf32=cuda and not a.no_encoder_tf32,
                            context="window")
    name = device_name(dec.device)
    rows = timeline(dec, a.batch, a.steps)
    print(f"{name}, codec {a.codec}, {a.vocoder}, batch {a.batch}: median of {a.steps} steps, ms since the step's "
          "start (GPU about host: the GPU waited for the host)")
    for k, h, g in rows:
        print(f"  {k:22s} host {h:8.3f}" + ("" if math.isnan(g) else f"  gpu {g:8.3f}"))


if __name__ == "__main__":
    main()
