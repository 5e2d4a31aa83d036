"""`moss-speech loadtest`: N simulated users against a running server; summary table, JSON report, plots."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from moss_speech.loadtest.audio import AudioError, Utterance, insert_pauses, load_utterance
from moss_speech.loadtest.config import LoadConfig, LoadConfigError
from moss_speech.loadtest.hardware import probe, server_counters

WORKER_SESSIONS = 64  # sessions one client process drives comfortably at 50 appends/s each


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with `bench capacity`."""
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--turns", type=int, default=2, help="turns per session (default 2)")
    p.add_argument("--ramp", type=float, default=0.0, metavar="PER_S",
                   help="sessions started per second (default 0 = all at once)")
    p.add_argument("--transport", choices=("ws", "webrtc"), default="ws")
    p.add_argument("--audio", default=None, metavar="WAV",
                   help="what each user says (PCM16 WAV, any rate; default: the repository's speech sample)")
    p.add_argument("--turn-detection", choices=("server_vad", "semantic_vad", "commit"), default="server_vad",
                   help="server_vad: stream silence after speech and let the server's VAD end the turn; "
                        "semantic_vad: the same, with the server's end-of-turn model (--eagerness); "
                        "commit: turn_detection null, the user commits and asks for a response")
    p.add_argument("--vad-silence-ms", type=int, default=300, help="silence_duration_ms for server_vad (300)")
    p.add_argument("--eagerness", choices=("low", "medium", "high", "auto"), default="auto",
                   help="semantic_vad's eagerness (default auto)")
    p.add_argument("--transcription", action="store_true",
                   help="ask the server to transcribe every user turn (audio.input.transcription) and time each "
                        "transcript from the commit (transcript_ms)")
    p.add_argument("--pauses", type=_pauses, default=None, metavar="MIN-MAX",
                   help="insert pauses of MIN-MAX ms into the utterance, one about every 1.2 s at its quietest "
                        "point (e.g. 300-700: speech that stops between clauses)")
    p.add_argument("--prebuffer-ms", type=float, default=60.0,
                   help="listener's jitter buffer before playback starts (default 60)")
    p.add_argument("--think-ms", type=float, default=500.0, help="pause between hearing the answer and speaking")
    p.add_argument("--turn-timeout", type=float, default=30.0, help="seconds from speech end to response.done")
    p.add_argument("--max-output-tokens", type=int, default=125,
                   help="answer length bound in model rows, 12.5 per second of audio (default 125 = 10 s)")
    p.add_argument("--api-key", default=os.environ.get("MOSS_LOADTEST_API_KEY"),
                   help="Bearer key if the server requires one (default: $MOSS_LOADTEST_API_KEY)")
    p.add_argument("--workers", type=int, default=0,
                   help=f"client processes (default 0 = one per {WORKER_SESSIONS} sessions, at most the CPU count)")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def _pauses(v: str) -> tuple[int, int]:
    lo, sep, hi = v.partition("-")
    try:
        return int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pauses must be MIN-MAX in ms, e.g. 300-700, got {v!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.add_argument("--sessions", type=int, default=4, help="concurrent simulated users (default 4)")
    p.add_argument("--duration", type=float, default=120.0,
                   help="hard bound on the run in seconds; turns in flight then are counted as cut (default 120)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full report here")
    p.add_argument("--plots", default=None, metavar="DIR", help="write ttfa_cdf.png and ttfa_timeline.png here")


def auto_workers(requested: int, sessions: int) -> int:
    if requested > 0:
        return requested
    return max(1, min(os.cpu_count() or 1, -(-sessions // WORKER_SESSIONS)))


def make_config(args: argparse.Namespace, sessions: int, duration_s: float) -> LoadConfig:
    return LoadConfig(
        url=args.url, sessions=sessions, turns=args.turns, duration_s=duration_s, ramp_per_s=args.ramp,
        transport=args.transport, turn_detection=args.turn_detection, vad_silence_ms=args.vad_silence_ms,
        eagerness=args.eagerness, transcription=args.transcription, pauses_ms=args.pauses,
        prebuffer_ms=args.prebuffer_ms, think_ms=args.think_ms, turn_timeout_s=args.turn_timeout,
        max_output_tokens=args.max_output_tokens, api_key=args.api_key,
        workers=auto_workers(args.workers, sessions))


def check_transport(cfg: LoadConfig) -> str | None:
    """None if the transport can run against this server; else why not."""
    if cfg.transport != "webrtc":
        return None
    from moss_speech.loadtest.client_webrtc import unavailable_reason

    return unavailable_reason(cfg)


def run_level(cfg: LoadConfig, utt: Utterance, hardware: dict[str, Any], progress: bool) -> dict[str, Any]:
    from moss_speech.loadtest.driver import run_load
    from moss_speech.loadtest.report import build_report

    before = server_counters(cfg)
    collector, wall_s = run_load(cfg, utt, progress=progress)
    after = server_counters(cfg)
    server = None if before is None or after is None else {k: after[k] - before[k] for k in after}
    return build_report(cfg, collector, wall_s, hardware, utt, server)


def prepare(args: argparse.Namespace, sessions: int, duration_s: float) -> tuple[LoadConfig, Utterance, dict] | int:
    """Config, utterance and hardware probe, or an exit code after printing why not."""
    try:
        cfg = make_config(args, sessions, duration_s)
        utt = load_utterance(args.audio)
        if cfg.pauses_ms is not None:
            utt = insert_pauses(utt, *cfg.pauses_ms)
    except (LoadConfigError, AudioError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why = check_transport(cfg)
    if why:
        print(f"error: --transport webrtc cannot run: {why}", file=sys.stderr)
        return 2
    hw = probe(cfg)
    health = hw.get("/health")
    if not isinstance(health, dict) or health.get("status") != 200:
        print(f"error: {cfg.http_url('/health')} is not healthy: {health}", file=sys.stderr)
        return 3
    print(f"hardware: {hw['gpu']}" + (f" (from {hw['source']})" if hw["source"] else " (the server does not say)"),
          file=sys.stderr)
    return cfg, utt, hw


def run(args: argparse.Namespace) -> int:
    prepared = prepare(args, args.sessions, args.duration)
    if isinstance(prepared, int):
        return prepared
    cfg, utt, hw = prepared
    from moss_speech.loadtest.report import format_table

    report = run_level(cfg, utt, hw, progress=not args.quiet)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"report: {args.json}")
    if args.plots:
        from moss_speech.loadtest import plots

        d = Path(args.plots)
        label = f"{cfg.sessions} sessions"
        ttfa = [r["ttfa_ms"] for r in report["turn_records"] if r["ttfa_ms"] is not None]
        plots.ttfa_cdf({label: ttfa}, d / "ttfa_cdf.png", f"TTFA, {cfg.transport}, {hw['gpu']}")
        plots.timeline(report["turn_records"], d / "ttfa_timeline.png", f"TTFA per turn, {label}")
        print(f"plots: {d}/ttfa_cdf.png {d}/ttfa_timeline.png")
    return 0 if report["errors"]["total"] == 0 else 1
