"""`moss-speech bench capacity`: raise concurrency until p95 TTFA passes its budget or underruns appear.

Capacity (docs/performance.md, Capacity) is the largest number of concurrent sessions with p95 TTFA under the budget,
no underruns, no errors and every turn answered. The server paces audio at real time, so a generation RTF
above 1 shows up to the listener as underruns: the underrun criterion is how the client sees RTF >= 1.
With server_vad, a level also fails when the server ends turns late: the p95 time from speech end to the commit more
than `--vad-lag-budget-ms` past the silence the VAD waits for. TTFA counts from the commit, so a server whose event
loop has fallen behind real time would otherwise pass (H200, one server process at 172 sessions: commits 1.6 s
after speech end at p50, with p95 TTFA from the commit at 298 ms).

With a VAD (server_vad, semantic_vad) each level is also judged on what the user feels, speech end -> first audio
(`ttfa_ms`, the detector's wait included), under its own budget (`--speech-end-budget-ms`), with the same
underrun, error and answered-turn criteria: that capacity is reported beside the commit-based one, and each level's
false starts per turn with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from moss_speech.loadtest.run import add_common_arguments, make_config, prepare, run_level

TTFA_METRICS = ("ttfa_commit_ms", "ttfa_ms", "server_ttfa_ms")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.add_argument("--start", type=int, default=1, help="first concurrency level (default 1)")
    p.add_argument("--step", type=int, default=1, help="added sessions per level (default 1)")
    p.add_argument("--max", type=int, default=8, help="last concurrency level tried (default 8)")
    p.add_argument("--ttfa-budget-ms", type=float, default=200.0, help="p95 TTFA budget (default 200)")
    p.add_argument("--ttfa-metric", choices=TTFA_METRICS, default="ttfa_commit_ms",
                   help="ttfa_commit_ms (default): from the commit (commit sent, or the server's "
                        "input_audio_buffer.committed received) to the first audio delta: the server's TTFA seen "
                        "from the client; ttfa_ms: from speech end (includes VAD silence); server_ttfa_ms: the "
                        "server's own number")
    p.add_argument("--vad-lag-budget-ms", type=float, default=200.0,
                   help="with server_vad: p95 of speech end -> commit may exceed --vad-silence-ms by this much "
                        "(default 200; the server's VAD adds ~100-150 ms when it keeps up)")
    p.add_argument("--speech-end-budget-ms", type=float, default=400.0,
                   help="with a VAD: p95 speech end -> first audio budget of the second capacity (default 400)")
    p.add_argument("--level-duration", type=float, default=180.0, help="bound on each level in seconds (180)")
    p.add_argument("--keep-going", action="store_true", help="run every level even after one fails")
    p.add_argument("--refine", type=int, default=0, metavar="K",
                   help="after the sweep, up to K more levels halving the gap between the capacity and the first "
                        "failing level above it (default 0), so a coarse --step still ends on a close figure")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unrecorded 1-session turn that first wakes the server (VAD model, kernels)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the curve and capacity here")
    p.add_argument("--plots", default=None, metavar="DIR", help="write capacity.png and ttfa_cdf.png here")


def levels(start: int, step: int, maximum: int) -> list[int]:
    if start < 1 or step < 1 or maximum < start:
        raise ValueError(f"need 1 <= --start <= --max and --step >= 1, got start {start}, step {step}, max {maximum}")
    return list(range(start, maximum + 1, step))


def capacity_of(curve: list[dict[str, Any]], key: str = "within") -> int:
    """The last level of the unbroken run of passing levels from the lowest one tried (0: the lowest fails)."""
    cap = 0
    for pt in sorted(curve, key=lambda pt: pt["sessions"]):
        if not pt.get(key):
            break
        cap = pt["sessions"]
    return cap


def next_refinement(curve: list[dict[str, Any]]) -> int | None:
    """The level halfway between the capacity and the first failing level above it (halfway to 0 when the lowest
    level fails), or None when no untried level lies between them."""
    cap = capacity_of(curve)
    above = [pt["sessions"] for pt in curve if pt["sessions"] > cap and not pt["within"]]
    if not above:
        return None
    mid = (cap + min(above)) // 2
    return mid if mid > cap and mid >= 1 else None


def verdict(report: dict[str, Any], metric: str, budget_ms: float, vad_silence_ms: float | None = None,
            vad_lag_budget_ms: float | None = None) -> list[str]:
    """Why this level is over capacity (empty list: it is within). `vad_silence_ms` (server_vad runs): the p95 time
    from speech end to the commit may exceed it by at most `vad_lag_budget_ms`."""
    why = []
    p95 = report["metrics"][metric]["p95"]
    if p95 is None:
        why.append(f"no {metric} measured")
    elif p95 > budget_ms:
        why.append(f"p95 {metric} {p95:.0f} ms > {budget_ms:.0f} ms")
    vad = report["metrics"].get("vad_delay_ms", {}).get("p95")
    if vad_silence_ms is not None and vad_lag_budget_ms is not None and vad is not None:
        if vad > vad_silence_ms + vad_lag_budget_ms:
            why.append(f"server behind real time: p95 speech end -> commit {vad:.0f} ms > {vad_silence_ms:.0f} ms "
                       f"of silence + {vad_lag_budget_ms:.0f}")
    if report["underruns"]["total"]:
        why.append(f"{report['underruns']['total']} underruns in {report['underruns']['turns_with_underruns']} turns")
    if report["errors"]["total"]:
        why.append(f"{report['errors']['total']} errors {report['errors']['by_code']}")
    t = report["turns"]
    if t["ok"] != t["planned"]:
        why.append(f"{t['ok']} of {t['planned']} turns answered cleanly ({t['timeout']} timeout, {t['cut']} cut)")
    return why


def _row(n: int, rep: dict[str, Any], metric: str, why: list[str], budget_ms: float) -> str:
    """One level's line. Where the p95's 90% interval (stats.percentile_interval) has the budget inside it, the
    verdict says so: another run of the same level may well come out the other way."""
    m = rep["metrics"][metric]
    f = lambda v: "-" if v is None else f"{v:.0f}"
    u = rep["underruns"]
    ci = m.get("p95_ci")
    span = "-" if ci is None else f"{ci[0]:.0f}-{ci[1]:.0f}"
    near = ci is not None and ci[0] <= budget_ms < ci[1]
    verdict_text = "ok" if not why else "OVER: " + "; ".join(why)
    if near:
        verdict_text += f" (the budget {budget_ms:.0f} ms is inside the p95's 90% interval)"
    return (f"{n:>8} {f(m['p50']):>7} {f(m['p95']):>7} {span:>11} {f(m['p99']):>7} "
            f"{u['turns_with_underruns']:>6}/{u['turns']:<5} {rep['errors']['total']:>6}  " + verdict_text)


def run(args: argparse.Namespace) -> int:
    try:
        plan = levels(args.start, args.step, args.max)
        if args.vad_lag_budget_ms < 0:
            raise ValueError(f"--vad-lag-budget-ms must be >= 0, got {args.vad_lag_budget_ms:g}")
        if args.refine < 0:
            raise ValueError(f"--refine must be >= 0, got {args.refine}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prepared = prepare(args, plan[0], args.level_duration)
    if isinstance(prepared, int):
        return prepared
    _, utt, hw = prepared
    metric = args.ttfa_metric
    # server_vad runs are judged on the VAD's lag too (module doc); commit runs have no VAD
    vad_silence, vad_budget = ((args.vad_silence_ms, args.vad_lag_budget_ms) if args.turn_detection == "server_vad"
                               else (None, None))  # (semantic_vad waits as long as its model says)
    print(f"capacity: hardware {hw['gpu']}; {args.transport}, {args.turn_detection}; prompt {utt.duration_s:.2f} s "
          f"of speech (~{utt.duration_s * 12.5:.0f} rows) per turn, {args.turns} turns per session; answers <= "
          f"{args.max_output_tokens} rows; floor: real time = one decode step per session every 80 ms "
          f"(12.5 codes/s); criteria: p95 {metric} <= {args.ttfa_budget_ms:.0f} ms, no underruns, no errors"
          + (f", p95 speech end -> commit <= {vad_silence + vad_budget:.0f} ms" if vad_silence is not None else ""))
    health = (hw.get("/health") or {}).get("body") if isinstance(hw.get("/health"), dict) else None
    limit = health.get("max_sessions") if isinstance(health, dict) else None
    if isinstance(limit, int) and limit < plan[-1]:
        print(f"warning: the server accepts at most {limit} sessions (MOSS_MAX_SESSIONS; MOSS_MAX_CALLS for WebRTC): "
              f"levels above it will fail with server_busy, not for lack of GPU", file=sys.stderr)
    if args.warmup:
        warm = run_level(replace(make_config(args, 1, args.level_duration), turns=1), utt, hw, progress=False)
        print(f"warm-up: 1 turn, {warm['turns']['ok']} ok, errors {warm['errors']['by_code'] or 0} (not recorded)")
    print(f"{'sessions':>8} {'p50':>7} {'p95':>7} {'p95 90%':>11} {'p99':>7} {'underrun turns':>12} {'errors':>6}  "
          "verdict")
    curve: list[dict[str, Any]] = []
    reports: list[dict[str, Any]] = []

    vad = args.turn_detection != "commit"

    def measure(n: int) -> bool:
        """Run one level; whether it passed (either criterion, with a VAD)."""
        rep = run_level(make_config(args, n, args.level_duration), utt, hw, progress=not args.quiet)
        why = verdict(rep, metric, args.ttfa_budget_ms, vad_silence, vad_budget)
        why_felt = verdict(rep, "ttfa_ms", args.speech_end_budget_ms) if vad else None
        row = _row(n, rep, metric, why, args.ttfa_budget_ms)
        if why_felt is not None:
            fs, felt = rep["false_starts"], rep["metrics"]["ttfa_ms"]
            row += (f" | speech end -> first audio p50 {felt['p50'] or 0:.0f} p95 {felt['p95'] or 0:.0f} ms: "
                    + ("ok" if not why_felt else "OVER") + f"; false starts {fs['per_turn']:.2f}/turn")
        print(row, flush=True)
        reports.append(rep)
        curve.append({"sessions": n, "within": not why, "reasons": why,
                      "within_speech_end": None if why_felt is None else not why_felt, "reasons_speech_end": why_felt,
                      **{k: rep[k] for k in ("metrics", "underruns", "errors", "turns", "wall_s", "client_lag_ms",
                                             "false_starts")}})
        return not why or (why_felt is not None and not why_felt)

    failed = False
    for n in plan:
        failed = not measure(n) or failed
        if failed and not args.keep_going:
            break
    for _ in range(args.refine):
        n = next_refinement(curve)
        if n is None:
            break
        measure(n)
    order = sorted(range(len(curve)), key=lambda i: curve[i]["sessions"])
    curve, reports = [curve[i] for i in order], [reports[i] for i in order]
    capacity = capacity_of(curve)
    tried = ", ".join(str(pt["sessions"]) for pt in curve)
    if capacity:
        print(f"capacity: {capacity} concurrent sessions (levels tried: {tried})")
    else:
        print(f"capacity: below {plan[0]} sessions: the first level already fails (levels tried: {tried})")
    capacity_felt = capacity_of(curve, "within_speech_end") if vad else None
    if vad:
        print(f"capacity by speech end -> first audio (p95 <= {args.speech_end_budget_ms:.0f} ms): "
              f"{capacity_felt} concurrent sessions")
    if not failed:
        print(f"note: every level up to --max {plan[-1]} passed; capacity is at least {capacity}")
    out = {"tool": "moss-speech bench capacity", "hardware": hw, "ttfa_metric": metric,
           "ttfa_budget_ms": args.ttfa_budget_ms, "vad_lag_budget_ms": vad_budget, "capacity": capacity,
           "speech_end_budget_ms": args.speech_end_budget_ms if vad else None,
           "capacity_speech_end": capacity_felt,
           "capacity_is_lower_bound": not failed, "curve": curve,
           "config": reports[0]["config"] if reports else None, "audio": reports[0]["audio"] if reports else None}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"report: {args.json}")
    if args.plots and curve:
        from moss_speech.loadtest import plots

        d = Path(args.plots)
        plots.capacity_curve(curve, d / "capacity.png", f"capacity on {hw['gpu']}: {capacity} sessions", metric)
        plots.ttfa_cdf({f"{r['sessions']['planned']} sessions": [t[metric] for t in r["turn_records"]
                                                                 if t[metric] is not None] for r in reports},
                       d / "ttfa_cdf.png", f"{metric} per load level, {hw['gpu']}")
        print(f"plots: {d}/capacity.png {d}/ttfa_cdf.png")
    return 0
