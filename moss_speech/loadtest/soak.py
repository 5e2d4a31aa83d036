"""`moss-speech bench soak`: sessions churning against one server for a long time, and whether anything drifts.

Each simulated user loops until the end: connect, then a few turns, each one of
  talk   a spoken turn (speech at real time, commit, answer heard to its end)
  barge  a spoken turn whose answer is cut by the next turn after its first audio (`response.cancel`)
  drop   a spoken turn whose socket is dropped without a close frame after the answer's first audio
and after the last turn a normal close (unless it dropped). Every few seconds the run samples the server's (with its
`--workers` processes) and the engine's resident memory (/proc, Linux), the engine's KV blocks in use and its
sessions (/health), and the server's underrun count (/metrics). The report: each measure's slope per hour (least
squares, after the first WARMUP_FRACTION of the run), KV blocks in use once every session has closed (a leak shows
there), underruns, and the p95 time to first audio (from the commit) over the first and over the last minute (after
one unrecorded warm-up turn). It exits 1 when KV blocks are still in use once every session has closed.

Without `--url` it starts `moss-speech serve` itself (the tiny random model on the CPU by default) and knows both
processes; with `--url` it measures what /health and /metrics say, and memory only with `--server-pid`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets

from moss_speech.loadtest.audio import load_utterance
from moss_speech.loadtest.stats import percentile

SAMPLE_EVERY_S = 5.0
WARMUP_FRACTION = 0.1  # memory grows while caches and pools fill: the slope is fitted after this part of the run
FRAME_MS = 100
KINDS = ("talk", "talk", "barge", "drop")  # what a turn does, drawn uniformly


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of churn (default 1800)")
    p.add_argument("--sessions", type=int, default=4, help="users churning at once (default 4)")
    p.add_argument("--stagger", type=float, default=0.0, metavar="S",
                   help="the users' first connections spread evenly over S seconds (default 0: all at once, so all "
                        "speak at once)")
    p.add_argument("--url", default=None, help="a running server (default: start `moss-speech serve` here)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for its memory")
    p.add_argument("--model", default="tiny-random", help="the started server's --model (default tiny-random)")
    p.add_argument("--codec", default="tiny-random", help="the started server's --codec (default tiny-random)")
    p.add_argument("--device", default="cpu", help="the started server's --device (default cpu)")
    p.add_argument("--max-output-tokens", type=int, default=60, help="answer bound in rows (default 60: 4.8 s)")
    p.add_argument("--window", type=float, default=60.0, help="seconds of the first and last TTFA windows (60)")
    p.add_argument("--no-compression", action="store_true",
                   help="users that do not ask for WebSocket compression (permessage-deflate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the report (samples and turns included)")


@dataclass
class Sample:
    t: float  # seconds since the start
    server_rss_mb: float | None
    engine_rss_mb: float | None
    kv_used: int | None
    engine_sessions: int | None
    underruns: float | None


@dataclass
class Turn:
    t: float
    kind: str
    ttfa_ms: float | None
    status: str  # response.done status, "dropped", or an error code


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    connects: int = 0
    errors: dict[str, int] = field(default_factory=dict)


# ---- measures ------------------------------------------------------------------------------------------------

def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) / 1024 if m else None


def children(parent: int) -> list[tuple[int, str]]:
    """(pid, command line) of each child of `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().decode(errors="replace")))
        except (OSError, ValueError, IndexError):
            continue
    return found


def server_and_engine_rss(server_pid: int) -> tuple[float | None, float | None]:
    """The front end's resident memory (the server process and, with `--workers`, its worker processes) and the
    engine process's."""
    kids = children(server_pid)
    engine = next((pid for pid, cmd in kids if "engines.process" in cmd), None)
    server = rss_mb(server_pid)
    if server is not None:
        server += sum(rss_mb(pid) or 0.0 for pid, _ in kids if pid != engine)
    return server, rss_mb(engine)


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def sample(http: httpx.AsyncClient, t: float, server_pid: int | None) -> Sample:
    engine = (await http.get("/health")).json().get("engine") or {}
    underruns = _metric((await http.get("/metrics")).text, "moss_audio_underruns_total")
    kv_used = engine["kv_total"] - engine["kv_free"] if "kv_total" in engine else None
    server_rss, engine_rss = server_and_engine_rss(server_pid) if server_pid is not None else (None, None)
    return Sample(round(t, 1), server_rss, engine_rss, kv_used, engine.get("sessions"), underruns)


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / var * 3600.0


def summary(run: Run, duration_s: float, window_s: float, kv_after: int | None) -> dict[str, Any]:
    after = WARMUP_FRACTION * duration_s

    def slope(key: str) -> float | None:
        pts = [(s.t, getattr(s, key)) for s in run.samples if s.t >= after and getattr(s, key) is not None]
        value = slope_per_hour(pts)
        return None if value is None else round(value, 3)

    def p95(lo: float, hi: float) -> float | None:
        xs = [x.ttfa_ms for x in run.turns if lo <= x.t < hi and x.ttfa_ms is not None]
        value = percentile(xs, 95)
        return None if value is None else round(value, 1)

    end = max((x.t for x in run.turns), default=duration_s)
    first, last = run.samples[0] if run.samples else None, run.samples[-1] if run.samples else None
    by_kind = {k: sum(x.kind == k for x in run.turns) for k in dict.fromkeys(KINDS)}
    return {
        "duration_s": duration_s,
        "turns": len(run.turns), "turns_by_kind": by_kind, "connects": run.connects, "errors": run.errors,
        "statuses": {s: sum(x.status == s for x in run.turns) for s in sorted({x.status for x in run.turns})},
        "server_rss_mb": {"first": first and first.server_rss_mb, "last": last and last.server_rss_mb,
                          "slope_per_hour": slope("server_rss_mb")},
        "engine_rss_mb": {"first": first and first.engine_rss_mb, "last": last and last.engine_rss_mb,
                          "slope_per_hour": slope("engine_rss_mb")},
        "kv_used": {"max": max((s.kv_used for s in run.samples if s.kv_used is not None), default=None),
                    "slope_per_hour": slope("kv_used"), "after_all_closed": kv_after},
        "underruns": (last.underruns or 0) - (first.underruns or 0) if first and last and last.underruns is not None
        else None,
        "ttfa_p95_ms": {"first_window": p95(0, window_s), "last_window": p95(end - window_s, end + 1),
                        "window_s": window_s},
    }


# ---- the users -----------------------------------------------------------------------------------------------

class User:
    def __init__(self, ws_url: str, frames: list[str], run: Run, t0: float, rng: random.Random,
                 max_output_tokens: int, compression: str | None = "deflate") -> None:
        self.ws_url = ws_url
        self.frames = frames
        self.run = run
        self.t0 = t0
        self.rng = rng
        self.max_output_tokens = max_output_tokens
        self.compression = compression

    def _error(self, code: str) -> None:
        self.run.errors[code] = self.run.errors.get(code, 0) + 1

    async def churn(self, deadline: float, delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        while time.monotonic() < deadline:
            try:
                await self._session(deadline)
            except (TimeoutError, OSError, websockets.WebSocketException) as e:
                self._error(type(e).__name__)
                await asyncio.sleep(1.0)  # the server is restarting or refusing: do not spin

    async def _session(self, deadline: float) -> None:
        ws = await websockets.connect(self.ws_url, max_size=None, open_timeout=30, compression=self.compression)
        self.run.connects += 1
        dropped = False
        try:
            await self._until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "max_output_tokens": self.max_output_tokens,
                "audio": {"input": {"turn_detection": None}}}}))
            await self._until(ws, "session.updated")
            for _ in range(self.rng.randint(1, 4)):
                if time.monotonic() >= deadline:
                    break
                kind = self.rng.choice(KINDS)
                if await self._turn(ws, kind):
                    dropped = True
                    return
        finally:
            if dropped:
                ws.transport.abort()  # no close frame: the server finds out from the socket
            else:
                await ws.close()

    async def _turn(self, ws: Any, kind: str) -> bool:
        """One turn; True if it dropped the connection."""
        start = time.monotonic()
        for frame in self.frames:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": frame}))
            await asyncio.sleep(FRAME_MS / 1000)  # a user speaks at real time
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        commit_t = time.monotonic()
        await ws.send(json.dumps({"type": "response.create"}))
        ttfa = None
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 120))
            etype = event["type"]
            if etype == "error":
                self._error(event["error"]["code"])
            elif etype == "response.output_audio.delta" and ttfa is None:
                ttfa = (time.monotonic() - commit_t) * 1000
                if kind == "drop":
                    self.run.turns.append(Turn(round(start - self.t0, 1), kind, round(ttfa, 1), "dropped"))
                    return True
                if kind == "barge":
                    await ws.send(json.dumps({"type": "response.cancel"}))
            elif etype == "response.done":
                self.run.turns.append(Turn(round(start - self.t0, 1), kind, None if ttfa is None else round(ttfa, 1),
                                           event["response"]["status"]))
                return False

    async def warm_up(self) -> None:
        """One spoken turn, not recorded: a fresh engine's first answers pay for its warm-up."""
        recorded = len(self.run.turns)
        with contextlib.suppress(Exception):
            await self._session(time.monotonic() + 1.0)
        del self.run.turns[recorded:]
        self.run.connects = 0
        self.run.errors.clear()

    async def _until(self, ws: Any, etype: str) -> None:
        while json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] != etype:
            pass


# ---- the run -------------------------------------------------------------------------------------------------

def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "MOSS_LOG_LEVEL": "warning", "MOSS_VAD": "false"}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "moss_speech.cli", "serve", "--port", str(port),
                                 "--model", args.model, "--codec", args.codec, "--device", args.device],
                                env=env, stdout=log, stderr=subprocess.STDOUT)


async def wait_ready(http: httpx.AsyncClient, proc: subprocess.Popen | None, timeout_s: float = 600.0
                     ) -> dict[str, Any]:
    """Until the server's /health says it is ready; returns what it says."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.TransportError, ValueError):
            r = await http.get("/health")
            if r.status_code == 200:
                return r.json()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready within {timeout_s:g} s")
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace, base: str, server_pid: int | None, proc: subprocess.Popen | None
               ) -> dict[str, Any]:
    run = Run()
    frames = load_utterance(None).frames_b64(FRAME_MS)
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        health = await wait_ready(http, proc)
        ws_url = base.replace("http", "ws", 1) + "/v1/realtime"
        compression = None if args.no_compression else "deflate"
        await User(ws_url, frames, run, 0.0, random.Random(-1), args.max_output_tokens, compression).warm_up()
        t0 = time.monotonic()
        deadline = t0 + args.duration
        users = [User(ws_url, frames, run, t0, random.Random(args.seed * 1000 + i), args.max_output_tokens, compression)
                 for i in range(args.sessions)]
        tasks = [asyncio.create_task(u.churn(deadline, i * args.stagger / len(users))) for i, u in enumerate(users)]
        while time.monotonic() < deadline:
            run.samples.append(await sample(http, time.monotonic() - t0, server_pid))
            last = run.samples[-1]
            print(f"soak t={last.t:.0f}s turns={len(run.turns)} server_rss={last.server_rss_mb} "
                  f"engine_rss={last.engine_rss_mb} kv_used={last.kv_used}", file=sys.stderr, flush=True)
            await asyncio.sleep(SAMPLE_EVERY_S)
        await asyncio.gather(*tasks)
        kv_after = await _kv_once_closed(http)
        run.samples.append(await sample(http, time.monotonic() - t0, server_pid))
    return {"config": run_config(args), "server": served(health),
            "summary": summary(run, args.duration, args.window, kv_after),
            "samples": [asdict(s) for s in run.samples], "turns": [asdict(x) for x in run.turns]}


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """This run's options; those of the server it starts only when it started one (not with --url)."""
    cfg = dict(vars(args))
    if args.url:
        for name in ("model", "codec", "device"):
            cfg.pop(name, None)
    return cfg


def served(health: dict[str, Any]) -> dict[str, Any]:
    """What the server said it serves (its /health): weights, codec and device."""
    engine = health.get("engine") if isinstance(health.get("engine"), dict) else {}
    return {"model": health.get("model"), "codec": health.get("codec"), "random_weights": health.get("random_weights"),
            "device": engine.get("device_name")}


async def _kv_once_closed(http: httpx.AsyncClient, timeout_s: float = 30.0) -> int | None:
    """KV blocks in use once the engine has no session left (None if sessions stay open past `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine = (await http.get("/health")).json().get("engine") or {}
        if engine.get("sessions") == 0 and engine.get("running") == 0:
            return engine["kv_total"] - engine["kv_free"]
        await asyncio.sleep(0.2)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    proc = None
    if args.url:
        base, server_pid = args.url.rstrip("/"), args.server_pid
    else:
        port = _free_port()
        log_path = Path(tempfile.gettempdir()) / f"moss-soak-serve-{port}.log"
        print(f"soak: server log {log_path}", file=sys.stderr)
        proc = start_server(args, port, log_path)
        base, server_pid = f"http://127.0.0.1:{port}", proc.pid
    try:
        report = asyncio.run(soak(args, base, server_pid, proc))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(json.dumps(report["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    # KV blocks held once every session has closed are a leak whatever the machine; the other measures are read.
    return 0 if report["summary"]["kv_used"]["after_all_closed"] == 0 else 1
