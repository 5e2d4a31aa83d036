"""Where answers' time to first audio went, from an engine log: p50 / p95 ms of each stage per load level, then
which stages make the slowest tenth of the turns slow (`tail`), and what the p95 would be were one stage's tail cut
(`cut`: each turn's TTFA less what that stage took over its median; the other stages as they were, so an upper
bound on what removing that tail alone could buy).

    python3 -m engines.profiling.stage_marks server.log 12 44 76 108

Reads the engine's "response X: first audio at N ms; stages {...}" lines (Service._complete), skips the warm-up,
and splits them into levels by count (2 answers per session: `bench capacity --turns 2`). Marks are ms from the
engine's CreateResponse; the commit's are negative (its arrival, the start of the encoder call that finalized it,
and its last codes).
Where the server logged at info (MOSS_LOG_LEVEL=info), its "response done id=X ... ttfa_ms=T" lines are joined by
response id: T is the turn's TTFA as the client sees it (commit sent to the engine -> first audio taken by the
transport), and "server share" is what the engine's marks do not cover: T - (engine TTFA - commit_in), i.e. the commit's
way in (server loop, socket, the engine's pickup) and the first audio's way out.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import re
import sys
from typing import TextIO

import numpy as np

from engines.process.options import int_at_least

LINE = re.compile(r"response (\S+): first audio at ([\d.]+) ms; stages (\{.*\})")
SERVER_LINE = re.compile(r"response done id=(\S+) status=\S+ reason=\S+ ttfa_ms=([\d.]+)")
# (label, from mark, to mark); None: the CreateResponse (0)
STAGES = [
    ("commit -> its codes", "commit_in", "commit_encoded"),
    ("(commit -> its call", "commit_in", "commit_call"),
    ("its call)", "commit_call", "commit_encoded"),
    ("codes -> CreateResponse", "commit_encoded", None),
    ("-> first row", None, "first_row"),
    # (first_chunk_codes: the answer has the codes its first audio waits for, its decoder stream's first_audio_codes)
    ("first row -> first audio's codes", "first_row", "first_chunk_codes"),
    ("its codes -> codec round", "first_chunk_codes", "codec_first_round_start"),
    ("first-chunk round", "codec_first_round_start", "codec_first_round_end"),
    ("round end -> out", "codec_first_round_end", "first_audio"),
]


def open_log(path: object) -> TextIO:
    """A server log as text, plain or gzipped (.gz: as gpu_capacity_pair.sh keeps them)."""
    return gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)


def read(path: str) -> list[tuple[float, dict[str, float]]]:
    """(engine TTFA, marks) per answer in log order; a mark "server_ttfa" where the server's line for it is there."""
    out, by_id, server = [], {}, {}
    with open_log(path) as f:
        for line in f:
            hit = LINE.search(line)
            if hit and "warm-up" not in hit.group(1):
                marks = ast.literal_eval(hit.group(3))
                by_id[hit.group(1)] = marks
                out.append((float(hit.group(2)), marks))
            elif (hit := SERVER_LINE.search(line)) is not None:
                server[hit.group(1)] = float(hit.group(2))
    for rid, ttfa in server.items():
        if rid in by_id:
            by_id[rid]["server_ttfa"] = ttfa
    return out


def server_share(ttfa: float, marks: dict[str, float]) -> float | None:
    """The turn's TTFA outside the engine's marks (commit's way in, first audio's way out), or None."""
    if "server_ttfa" not in marks or "commit_in" not in marks:
        return None
    return marks["server_ttfa"] - (ttfa - marks["commit_in"])


def pct(values: list[float]) -> str:
    return f"{np.percentile(values, 50):.0f} / {np.percentile(values, 95):.0f}" if values else "-"


def span(marks: dict[str, float], a: str | None, b: str | None) -> float | None:
    if (a is not None and a not in marks) or (b is not None and b not in marks):
        return None
    return (0.0 if b is None else marks[b]) - (0.0 if a is None else marks[a])


def client_ttfa(part: list[tuple[float, dict[str, float]]]) -> np.ndarray:
    """Each answer's TTFA as the client sees it (the server's line), the engine's where that line is missing."""
    return np.asarray([d.get("server_ttfa", t) for t, d in part])


def tail(part: list[tuple[float, dict[str, float]]], worst: float = 0.1, middle: tuple[float, float] = (0.3, 0.7)
         ) -> str:
    """Which stages make the slow turns slow: each stage's mean over the `worst` share of the turns (by the client's
    TTFA, the engine's where the server's line is missing) minus its mean over the `middle` ones, in ms."""
    if len(part) < 10:
        return "tail: too few answers"
    ttfa = client_ttfa(part)
    order = np.argsort(ttfa, kind="stable")
    n = len(order)
    slow, mid = order[int(n * (1 - worst)):], order[int(n * middle[0]):int(n * middle[1])]

    def mean(rows: np.ndarray, a: str | None, b: str | None) -> float | None:
        values = [v for i in rows if (v := span(part[i][1], a, b)) is not None]
        return float(np.mean(values)) if values else None

    cols = [f"TTFA {ttfa[slow].mean():.0f} against {ttfa[mid].mean():.0f}"]
    for label, a, b in STAGES:
        s, m = mean(slow, a, b), mean(mid, a, b)
        if s is not None and m is not None:
            cols.append(f"{label.strip('()')} {s - m:+.0f}")
    return (f"tail (worst {worst:.0%} of turns against the middle {middle[1] - middle[0]:.0%}, mean ms): "
            + "; ".join(cols))


def cut(part: list[tuple[float, dict[str, float]]]) -> str:
    """The TTFA p95 (the client's where the server logged it) were each stage's tail cut: every turn's TTFA less
    what the stage took over its median (turns without the stage's marks as they were), one stage at a time."""
    if len(part) < 10:
        return "cut: too few answers"
    ttfa = client_ttfa(part)
    cols = [f"TTFA {np.percentile(ttfa, 95):.0f}"]
    for label, a, b in STAGES:
        took = [span(d, a, b) for _, d in part]
        known = [v for v in took if v is not None]
        if not known:
            continue
        median = float(np.median(known))
        over = np.asarray([0.0 if v is None else max(0.0, v - median) for v in took])
        cols.append(f"{label.strip('()')} {np.percentile(ttfa - over, 95):.0f}")
    return "p95 were one stage's tail cut to its median (ms): " + "; ".join(cols)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="the engine's log (plain or .gz)")
    p.add_argument("sessions", nargs="*", type=int_at_least(1),
                   help="each load level's sessions, in the log's order (2 answers a session); none: one level")
    args = p.parse_args(argv)
    answers = read(args.log)
    sizes = [2 * n for n in args.sessions] or [len(answers)]
    print(f"{len(answers)} answers; stage p50 / p95 ms")
    start = 0
    for sessions, size in zip(args.sessions or ["all"], sizes, strict=True):
        part, start = answers[start:start + size], start + size
        cols = [f"engine TTFA {pct([t for t, _ in part])}"]
        if any("server_ttfa" in d for _, d in part):
            cols.append(f"server TTFA {pct([d['server_ttfa'] for _, d in part if 'server_ttfa' in d])}")
            cols.append(f"server share {pct([v for t, d in part if (v := server_share(t, d)) is not None])}")
        for label, a, b in STAGES:
            cols.append(f"{label} {pct([v for _, d in part if (v := span(d, a, b)) is not None])}")
        print(f"{sessions} sessions ({len(part)} answers): " + "; ".join(cols))
        print(f"{sessions} sessions {tail(part)}")
        print(f"{sessions} sessions {cut(part)}")


if __name__ == "__main__":
    main(sys.argv[1:])
