"""What a loaded engine process's GPU was doing: `python3 -m engines.profiling.window_report WINDOW.npz`.

Reads the events an engine process recorded with `--gpu-window` (engines/process/observe/gpu_window.py) and prints,
per part
of the process (its streams recognised by the kernels they run), the share of the window its streams were busy, its
kernel count and kernel time; then the language model's step launches (a CUDA graph replay, or an eager step's
kernels, is one launch): how long each took and how far apart they started.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from engines.process.observe.gpu_window import Events, busy_us

# The first part whose marker names one of a stream's kernels owns the stream (Triton kernel names of each part).
PARTS = (
    ("language model", ("_skinny_kernel", "_embed_rope_kernel", "_varlen_kernel", "_candidates_kernel")),
    ("codec flow (estimator, flow encoder)", ("_window_attention_kernel", "_ln_linear_kernel")),
    ("codec vocoder (HiFT)", ("_snake_kernel",)),
    # (_tf32x3_gemm: the encoder GEMM's name in windows recorded before 2026-11-29)
    ("speech encoder", ("_encoder_attention", "_encoder_gemm", "_tf32x3_gemm", "fmha_cutlassF_f32", "gemmSN_TN_kernel",
                        "f32f32_f32f32")),
)


def part_of(kernel_names: set[str]) -> str:
    for part, markers in PARTS:
        if any(m in n for n in kernel_names for m in markers):
            return part
    return "other"


def streams_by_part(ev: Events) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in np.unique(ev.stream):
        names = {ev.names[i] for i in np.unique(ev.name[ev.stream == s])}
        out.setdefault(part_of(names), []).append(int(s))
    return out


def launches(ev: Events, streams: list[int], min_kernels: int) -> np.ndarray:
    """[n, 2] (start, end) in us of the launches on these streams with at least `min_kernels` kernels."""
    sel = np.isin(ev.stream, streams)
    corr, start, end = ev.correlation[sel], ev.start[sel], ev.start[sel] + ev.duration[sel]
    keys, inv, counts = np.unique(corr, return_inverse=True, return_counts=True)
    first = np.full(len(keys), np.inf)
    last = np.zeros(len(keys))
    np.minimum.at(first, inv, start)
    np.maximum.at(last, inv, end)
    spans = np.stack([first, last], axis=1)[counts >= min_kernels]
    return spans[np.argsort(spans[:, 0])]


def report(ev: Events, min_step_kernels: int = 50) -> list[str]:
    span = float((ev.start + ev.duration).max()) if len(ev.start) else 0.0
    lines = [f"window {span / 1e3:.0f} ms; any stream busy {100 * busy_us(ev.start, ev.duration) / max(span, 1):.0f}%"]
    parts = streams_by_part(ev)
    for part, streams in sorted(parts.items(), key=lambda kv: kv[0]):
        sel = np.isin(ev.stream, streams)
        busy = busy_us(ev.start[sel], ev.duration[sel])
        lines.append(f"{part}: {len(streams)} streams, {int(sel.sum())} kernels ({sel.sum() / max(span, 1) * 1e3:.0f} "
                     f"per ms), busy {100 * busy / max(span, 1):.0f}% of the window, kernel time "
                     f"{ev.duration[sel].sum() / 1e3:.1f} ms")
    steps = launches(ev, parts.get("language model", []), min_step_kernels)
    if len(steps) > 1:
        p10, p50, p90 = np.percentile((steps[:, 1] - steps[:, 0]) / 1e3, [10, 50, 90])
        apart = np.diff(steps[:, 0]) / 1e3
        lines.append(f"language model: {len(steps)} step launches of >= {min_step_kernels} kernels; each took "
                     f"p10/p50/p90 {p10:.1f} / {p50:.1f} / {p90:.1f} ms, starts {np.median(apart):.1f} ms apart (p50)")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("window", type=Path, help="the .npz an engine process wrote (--gpu-window)")
    p.add_argument("--min-step-kernels", type=int, default=50,
                   help="a language-model launch with this many kernels or more is a step (graph replays)")
    args = p.parse_args(argv)
    print("\n".join(report(Events.load(args.window), args.min_step_kernels)))


if __name__ == "__main__":
    main()
