"""An A/B pair's runs pooled per label: TTFA p95 over all of a label's turns, and each label's difference from the
first one with a bootstrap interval, from the server logs `gpu_capacity_pair.sh` writes.

    python3 -m engines.profiling.pair_compare DIR_OR_LOG...   (server-<label>-<n>.log[.gz], from one call or several)

A single run's p95 over 512 turns has a 90% interval ~20 ms wide, as wide as the effects the pairs look for; pooling
a label's runs (ABBA) narrows it. The TTFA is the server's per-turn line (MOSS_LOG_LEVEL=info: commit sent to the
engine -> first audio taken by the transport, what `bench capacity` reports as ttfa_commit_ms to within a few ms).
The interval resamples turns within each run (a run keeps its own turns' count), so it covers the turns' spread,
not a shift that a whole run takes (a slower machine): read it beside the per-run p95s printed with it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

from engines.profiling.stage_marks import SERVER_LINE, open_log  # the server's per-turn line, read the same way there

NAME = re.compile(r"server-(?P<label>[^-]+)-(?P<n>\d+)\.log(\.gz)?$")


def server_ttfas(path: Path) -> np.ndarray:
    """The server's per-turn TTFA (ms) in one log, warm-up turns (no server line) aside."""
    with open_log(path) as f:
        return np.asarray([float(hit.group(2)) for line in f if (hit := SERVER_LINE.search(line))])


def runs_by_label(args: list[str]) -> dict[str, list[tuple[str, np.ndarray]]]:
    """{label: [(run name, its TTFAs)]} in the order labels first appear; directories are searched for logs."""
    paths: list[Path] = []
    for a in args:
        p = Path(a)
        paths += sorted(q for q in p.iterdir() if NAME.search(q.name)) if p.is_dir() else [p]
    out: dict[str, list[tuple[str, np.ndarray]]] = {}
    for p in paths:
        hit = NAME.search(p.name)
        if hit is None:
            raise SystemExit(f"{p}: not a pair's server log (server-<label>-<n>.log[.gz])")
        ttfa = server_ttfas(p)
        if ttfa.size == 0:
            raise SystemExit(f"{p}: no server TTFA lines (was the server logging at info?)")
        out.setdefault(hit.group("label"), []).append((str(p), ttfa))
    return out


def p95_shift(base: list[np.ndarray], other: list[np.ndarray], draws: int = 2000, seed: int = 0
              ) -> tuple[float, float, float]:
    """other's pooled p95 minus base's: the observed difference and the 5th / 95th percentiles of its bootstrap."""
    rng = np.random.default_rng(seed)

    def resample(runs: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([r[rng.integers(0, r.size, r.size)] for r in runs])

    shifts = [np.percentile(resample(other), 95) - np.percentile(resample(base), 95) for _ in range(draws)]
    observed = float(np.percentile(np.concatenate(other), 95) - np.percentile(np.concatenate(base), 95))
    lo, hi = np.percentile(shifts, [5, 95])
    return observed, float(lo), float(hi)


def report(groups: dict[str, list[tuple[str, np.ndarray]]]) -> list[str]:
    labels = list(groups)
    lines = []
    for label in labels:
        runs = groups[label]
        pooled = np.concatenate([t for _, t in runs])
        each = ", ".join(f"{np.percentile(t, 95):.0f}" for _, t in runs)
        lines.append(f"{label}: {len(runs)} run(s), {pooled.size} turns: p50 {np.percentile(pooled, 50):.0f} / "
                     f"p95 {np.percentile(pooled, 95):.0f} ms (runs' p95: {each})")
    base = [t for _, t in groups[labels[0]]]
    for label in labels[1:]:
        d, lo, hi = p95_shift(base, [t for _, t in groups[label]])
        lines.append(f"{label} - {labels[0]}: p95 {d:+.1f} ms [{lo:+.1f} .. {hi:+.1f}] (90%, turns resampled "
                     "within runs)")
    return lines


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    print("\n".join(report(runs_by_label(argv))))


if __name__ == "__main__":
    main(sys.argv[1:])
