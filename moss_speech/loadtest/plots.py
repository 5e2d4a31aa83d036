"""PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

TTFA_BUDGET_MS = 200.0


def ttfa_cdf(levels: dict[str, list[float]], path: Path, title: str) -> Path:
    """One empirical CDF of TTFA per load level (label -> TTFA values in ms)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs in levels.items():
        xs = sorted(xs)
        if not xs:
            continue
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{label} (n={len(xs)})")
    ax.axvline(TTFA_BUDGET_MS, color="grey", ls="--", lw=1, label=f"{TTFA_BUDGET_MS:.0f} ms")
    ax.axhline(0.95, color="grey", ls=":", lw=1)
    ax.set_xlabel("TTFA [ms]")
    ax.set_ylabel("fraction of turns")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def timeline(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """TTFA of every turn against the time it started; turns with underruns in red."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [(r["start_s"], r["ttfa_ms"]) for r in records if r.get("ttfa_ms") is not None and not r["underruns"]]
    bad = [(r["start_s"], r["ttfa_ms"]) for r in records if r.get("ttfa_ms") is not None and r["underruns"]]
    if ok:
        ax.scatter(*zip(*ok, strict=True), s=12, label="no underrun")
    if bad:
        ax.scatter(*zip(*bad, strict=True), s=16, color="red", label="underrun(s)")
    ax.axhline(TTFA_BUDGET_MS, color="grey", ls="--", lw=1)
    ax.set_xlabel("turn start [s since run start]")
    ax.set_ylabel("TTFA [ms]")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def capacity_curve(curve: list[dict[str, Any]], path: Path, title: str, ttfa_key: str) -> Path:
    """TTFA percentiles (left axis) and underrun share (right axis) against concurrent sessions."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = [pt["sessions"] for pt in curve]
    for q, style in (("p50", "-o"), ("p95", "-s"), ("p99", "-^")):
        ax.plot(n, [pt["metrics"][ttfa_key][q] for pt in curve], style, label=f"TTFA {q}")
    # The p95's 90% interval where a level had the turns for one (stats.percentile_interval).
    ci = [(pt["sessions"], pt["metrics"][ttfa_key]["p95"], pt["metrics"][ttfa_key].get("p95_ci")) for pt in curve]
    ci = [(x, y, c) for x, y, c in ci if c is not None and y is not None]
    if ci:
        ax.errorbar([x for x, _, _ in ci], [y for _, y, _ in ci], fmt="none", ecolor="grey", capsize=3,
                    yerr=[[y - c[0] for _, y, c in ci], [c[1] - y for _, y, c in ci]], label="p95, 90% interval")
    ax.axhline(TTFA_BUDGET_MS, color="grey", ls="--", lw=1, label=f"{TTFA_BUDGET_MS:.0f} ms budget")
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("TTFA [ms]")
    ax2 = ax.twinx()
    ax2.bar(n, [_underrun_share(pt) for pt in curve], width=max(1, (max(n) - min(n)) / 40 if len(n) > 1 else 1),
            alpha=0.3, color="red", label="turns with underruns")
    ax2.set_ylabel("turns with underruns [%]")
    ax2.set_ylim(0, 100)
    lines, labels = ax.get_legend_handles_labels()
    l2, lb2 = ax2.get_legend_handles_labels()
    ax.legend(lines + l2, labels + lb2, fontsize=8, loc="upper left")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _underrun_share(pt: dict[str, Any]) -> float:
    u = pt["underruns"]
    return 100.0 * u["turns_with_underruns"] / u["turns"] if u["turns"] else 0.0


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
