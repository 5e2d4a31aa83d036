"""The run's JSON report and the summary table printed on stdout."""

from __future__ import annotations

import datetime as dt
from typing import Any

from moss_speech.loadtest.audio import Utterance
from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.results import Collector
from moss_speech.loadtest.stats import summarize

REPORT_VERSION = 2
# Summaries every report carries (name -> unit); the table prints them in this order.
METRICS = {
    "heard_ms": "ms",
    "ttfa_ms": "ms",
    "ttfa_commit_ms": "ms",
    "server_ttfa_ms": "ms",
    "vad_delay_ms": "ms",
    "transcript_ms": "ms",
    "gap_ms": "ms",
    "rtf": "",
    "audio_s": "s",
    "stall_ms": "ms",
}


def build_report(cfg: LoadConfig, c: Collector, wall_s: float, hardware: dict[str, Any],
                 utt: Utterance, server: dict[str, float] | None = None) -> dict[str, Any]:
    """`server`: the server's speculation counters over the run (hardware.server_counters), if it serves them."""
    recs = sorted(c.records, key=lambda r: (r.session, r.turn))
    done = [r for r in recs if r.status in ("ok", "error")]  # turns that reached response.done
    by_status = {s: sum(1 for r in recs if r.status == s) for s in ("ok", "error", "timeout", "cut")}
    metrics = {
        "heard_ms": summarize(r.heard_ms for r in done),
        "ttfa_ms": summarize(r.ttfa_ms for r in done),
        "ttfa_commit_ms": summarize(r.ttfa_commit_ms for r in done),
        "server_ttfa_ms": summarize(r.server_ttfa_ms for r in done),
        "vad_delay_ms": summarize(r.vad_delay_ms for r in done),
        "transcript_ms": summarize(r.transcript_ms for r in recs),
        "gap_ms": summarize(g for r in done for g in r.gaps_ms),
        "rtf": summarize(r.rtf for r in done),
        "audio_s": summarize(r.audio_s for r in done),
        "stall_ms": summarize(r.stall_ms for r in done),
    }
    return {
        "report_version": REPORT_VERSION,
        "tool": "moss-speech loadtest",
        "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "wall_s": round(wall_s, 3),
        "config": cfg.public_dict(),
        "audio": {"source": utt.source, "speech_s": round(utt.duration_s, 3)},
        "hardware": hardware,
        "sessions": {"planned": cfg.sessions, "started": c.sessions_started, "connected": c.sessions_connected,
                     "ended": c.sessions_ended},
        "turns": {"planned": cfg.sessions * cfg.turns, "recorded": len(recs), **by_status},
        "metrics": metrics,
        "underruns": {"total": sum(r.underruns for r in done), "turns_with_underruns": sum(
            1 for r in done if r.underruns), "turns": len(done)},
        "errors": {"total": sum(c.errors.values()), "by_code": dict(sorted(c.errors.items())),
                   "samples": dict(sorted(c.error_samples.items()))},
        "extra_responses": c.extra_responses,
        "false_starts": _false_starts(recs, server),
        "client_lag_ms": summarize(c.client_lag_ms),
        "turn_records": [r.to_dict(with_gaps=False) for r in recs],
    }


def _false_starts(recs: list, server: dict[str, float] | None) -> dict[str, Any]:
    """Answers begun on a pause: those the client saw (a response begun while the user still spoke), those the
    server withdrew unseen, and turns where answer audio came while the user was still speaking."""
    turns = len(recs) or 1
    seen = sum(r.false_starts for r in recs)
    out: dict[str, Any] = {"seen_by_client": seen, "talked_over_turns": sum(1 for r in recs if r.talked_over),
                           "withdrawn": None, "confirmed": None, "withdrawn_rows": None}
    if server is not None:
        out.update({k: int(v) for k, v in server.items()})
    out["per_turn"] = round((seen + (out["withdrawn"] or 0)) / turns, 3)
    return out


def _fmt(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s" or unit == "":
        return f"{v:.2f}"
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.1f}"


def format_table(report: dict[str, Any]) -> str:
    cfg, t, u, e = report["config"], report["turns"], report["underruns"], report["errors"]
    lines = [
        f"moss-speech loadtest  {cfg['url']}  transport {cfg['transport']}  turn detection {cfg['turn_detection']}",
        f"hardware: {report['hardware'].get('gpu', 'unknown')}   speech {report['audio']['speech_s']:.2f} s per turn"
        f"   wall {report['wall_s']:.1f} s",
        f"sessions {report['sessions']['connected']}/{report['sessions']['planned']} connected   turns: "
        f"{t['ok']} ok, {t['error']} error, {t['timeout']} timeout, {t['cut']} cut of {t['planned']} planned",
        "",
        f"{'metric':<16}{'count':>7}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}",
    ]
    for name, unit in METRICS.items():
        m = report["metrics"][name]
        label = f"{name}" if not unit or name.endswith(unit) else f"{name} [{unit}]"
        lines.append(f"{label:<16}{m['count']:>7}" + "".join(f"{_fmt(m[k], unit):>9}" for k in ("p50", "p95", "p99",
                                                                                                 "max")))
    lines += [
        "",
        f"underruns: {u['total']} in {u['turns_with_underruns']} of {u['turns']} turns",
        f"errors: {e['total']}" + ("  " + ", ".join(f"{k}={v}" for k, v in e["by_code"].items()) if e["total"] else ""),
    ]
    lag = report["client_lag_ms"]
    if lag["max"] is not None and lag["max"] > 50:
        lines.append(f"WARNING: the load generator fell behind real time by up to {lag['max']:.0f} ms; "
                     "use more --workers or a bigger client machine")
    fs = report["false_starts"]
    lines.append(f"false starts: {fs['per_turn']:.2f} per turn ({fs['seen_by_client']} seen by clients, "
                 + ("withdrawn unseen: not reported by the server" if fs["withdrawn"] is None else
                    f"{fs['withdrawn']} withdrawn unseen wasting {fs['withdrawn_rows']} engine rows, "
                    f"{fs['confirmed']} speculative answers confirmed")
                 + f"); answers heard over a speaking user: {fs['talked_over_turns']} turns")
    if report["extra_responses"]:
        lines.append(f"note: {report['extra_responses']} responses the users did not ask for (VAD split a turn?)")
    return "\n".join(lines)
