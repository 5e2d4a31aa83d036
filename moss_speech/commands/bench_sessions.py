"""`moss-speech bench sessions`: the server process's own CPU cost per real-time session.

A server process holds every session's event loop work: decoding `input_audio_buffer.append` events,
resampling to 16 kHz, the VAD, and the outbound queue. Its asyncio loop is one thread, so whatever a
session costs there bounds how many sessions one process can serve at real time, whatever the GPU does.

N in-process sessions with `server_vad` each get a 20 ms append event (base64 PCM16 at 24 kHz: the load
test's utterance, the repository's speech sample trimmed, then a second of silence, over and over) at real
time, through the same `Session.handle_client_text` a WebSocket reader calls; a writer task per session
drains its outbound queue as the WebSocket writer would. The engine is a link that records and answers
nothing, so only the server's side is measured. Reported: CPU ms per session-second (all threads of this
process), the sessions one core would carry at that rate, and how late the loop delivered frames (p50 /
p99 / max): lateness that grows over the run means the loop cannot keep up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from engines.bench.hardware import cpu_model
from moss_speech.commands.arguments import counts
from moss_speech.loadtest.audio import DEFAULT_WAV, load_utterance, silence_frame_b64
from moss_speech.loadtest.user import append_message
from server.session.session import Session
from server.vad import VadBatcher

FRAME_MS = 20


class _NullEngine:
    """Accepts what a session sends to the engine and answers nothing."""

    ready = True

    async def send(self, msg: Any) -> None:
        pass

    def register(self, sid: str, s: Any) -> None:
        pass

    def unregister(self, sid: str) -> None:
        pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=counts, default="32,128,256", help="comma-separated session counts, one run each")
    p.add_argument("--seconds", type=float, default=10.0, help="timed real-time seconds per run")
    p.add_argument("--audio", default=str(DEFAULT_WAV), help="what each user says (WAV, any rate)")
    p.add_argument("--json", default=None)


def frames(path: str) -> list[str]:
    """A user's turn as append events, 20 ms each: the load test's utterance (speech, trimmed), then 1 s of
    silence; encoded as the load test's users send them."""
    silence = [silence_frame_b64(FRAME_MS)] * (1000 // FRAME_MS)
    return [append_message(f) for f in load_utterance(path).frames_b64(FRAME_MS) + silence]


async def one_run(n: int, seconds: float, turn: list[str]) -> dict[str, Any]:
    batcher = VadBatcher()
    sessions = [Session(f"sess_{i}", _NullEngine(), vad_factory=batcher.stream) for i in range(n)]
    for s in sessions:
        await s.start()
    late: list[float] = []
    t0 = time.perf_counter() + 0.5  # every user's first frame is in the future
    end = t0 + seconds

    async def user(i: int, s: Session) -> None:
        k = (i * 7) % len(turn)  # users at different places in their turn
        start = t0 + (i % 50) * FRAME_MS / 50 / 1000  # and spread within a frame
        j = 0
        while (due := start + j * FRAME_MS / 1000) < end:
            if (wait := due - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            late.append(time.perf_counter() - due)
            await s.handle_client_text(turn[k % len(turn)])
            k += 1
            j += 1

    commits = 0  # turns the VAD ended (each user's speech ends once per turn)

    async def writer(s: Session) -> None:
        nonlocal commits
        while (item := await s.outbound.get()) is not None:
            commits += isinstance(item, dict) and item.get("type") == "input_audio_buffer.committed"

    writers = [asyncio.create_task(writer(s)) for s in sessions]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(user(i, s) for i, s in enumerate(sessions)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for s in sessions:
        await s.close()
    for w in writers:
        w.cancel()
    per = cpu * 1e3 / (n * seconds)
    lat = np.array(late) * 1e3
    return {"sessions": n, "seconds": seconds, "frames": len(late), "turns_detected": commits,
            "wall_s": wall, "cpu_s": cpu, "cpu_ms_per_session_s": per,
            "sessions_per_core": 1000.0 / per, "late_ms": {"p50": float(np.percentile(lat, 50)),
                                                           "p99": float(np.percentile(lat, 99)),
                                                           "max": float(lat.max())}}


def run(args: argparse.Namespace) -> int:
    turn = frames(args.audio)
    results = []
    cpu = f"{cpu_model()}, {os.cpu_count()} CPUs"
    print(f"{cpu}; {FRAME_MS} ms append events at real time, server_vad, null engine")
    for n in args.sessions:
        r = asyncio.run(one_run(n, args.seconds, turn))
        results.append(r)
        lt = r["late_ms"]
        print(f"sessions {n:4d}: {r['cpu_ms_per_session_s']:6.2f} CPU ms per session-second "
              f"({r['sessions_per_core']:5.0f} sessions per core), CPU {r['cpu_s'] / r['wall_s']:.2f} cores, "
              f"frames late p50 {lt['p50']:.1f} / p99 {lt['p99']:.1f} / max {lt['max']:.1f} ms, "
              f"{r['turns_detected']} turns detected")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "runs": results}, indent=1))
    return 0
