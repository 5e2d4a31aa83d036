"""The engine's "load parts" lines (every 5 s at MOSS_LOG_LEVEL=info: each part's count, mean and max) summed over a
whole run, one column per log: how many encoder calls, codec rounds and first-chunk rounds a run made and how long
they took. A pair's runs differ in these where the stage marks only show their effect (2026-11-29: a tree that made
~10% more commit calls and first-chunk rounds for the same turns).

    python3 -m engines.profiling.load_parts server-A-1.log.gz server-B-2.log.gz [--parts "encode,encode commits"]

Each row: count x mean ms (max ms) per log; parts in the first log's order of total time.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from engines.profiling.stage_marks import open_log

# One part as engines.process.observe.spans.Spans.describe writes it: "name 12x 3.1 ms (max 9)".
PART = re.compile(r"(?:^|, )(?P<name>[^,]+?) (?P<n>\d+)x (?P<mean>[\d.]+) ms \(max (?P<max>\d+)\)")


def read(path: Path) -> dict[str, tuple[int, float, float]]:
    """{part: (count, total ms, max ms)} over every "load parts" line of one log (.log or .log.gz)."""
    out: dict[str, tuple[int, float, float]] = {}
    with open_log(path) as f:
        for line in f:
            if "load parts: " not in line:
                continue
            for hit in PART.finditer(line.split("load parts: ", 1)[1].rstrip("\n")):
                n, mean, mx = int(hit["n"]), float(hit["mean"]), float(hit["max"])
                c, total, top = out.get(hit["name"], (0, 0.0, 0.0))
                out[hit["name"]] = (c + n, total + n * mean, max(top, mx))
    return out


def table(runs: list[tuple[str, dict[str, tuple[int, float, float]]]], parts: list[str] | None = None) -> list[str]:
    if not runs:
        return []
    first = runs[0][1]
    names = parts or sorted(first, key=lambda k: -first[k][1])
    names += [] if parts else sorted({k for _, r in runs[1:] for k in r} - set(names))
    width = max([len(n) for n in names] + [4])
    lines = [f"{'part':{width}s}  " + "  ".join(f"{label:>24s}" for label, _ in runs)]
    for name in names:
        cells = []
        for _, r in runs:
            if name in r and r[name][0]:
                n, total, mx = r[name]
                cells.append(f"{f'{n}x {total / n:.1f} ({mx:.0f})':>24s}")
            else:
                cells.append(f"{'-':>24s}")
        lines.append(f"{name:{width}s}  " + "  ".join(cells))
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--parts", default=None, help="comma-separated part names to show, in this order")
    args = p.parse_args(argv)
    runs = [(Path(x).name.removesuffix(".gz").removesuffix(".log"), read(Path(x))) for x in args.logs]
    print("\n".join(table(runs, args.parts.split(",") if args.parts else None)))


if __name__ == "__main__":
    main()
