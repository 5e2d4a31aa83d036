"""How long end-of-turn questions wait for the model in one server process (server/turn_model.py, `EndOfTurnQueue`,
the shipped Smart Turn on the CPU), under arrivals shaped like many sessions' pauses: a question every `--gap-ms` on
average, 30% of them falling together on a 250 ms grid (sessions pausing at the same moment), 60% withdrawn if not
answered within 150 ms (the user spoke on: the pause ended). Prints the wait of the answered questions, the model's
own call time, and how many were withdrawn unanswered. Seeded: the same arrivals every run.

    python3 docs/bench/end_of_turn_queue.py --gap-ms 35    # ~100% of one thread on a 2-core development box
    python3 docs/bench/end_of_turn_queue.py --gap-ms 70    # ~50%

What else a server process runs beside the model: `--vad-streams N` classifies N sessions' audio in real time with
the served VAD batcher (server/vad.py) in the same process, and `--processes P` runs P such processes at once, as
`moss-speech serve --workers P` does. Each keeps torch and numpy's BLAS on one thread as a served process does
(server/vad.py, `one_thread_pools`); `--default-pools` leaves them at a thread per core, to see what that costs:

    python3 docs/bench/end_of_turn_queue.py --processes 4 --vad-streams 32 --gap-ms 250 --questions 120 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import time

import numpy as np

from moss_speech.loadtest.stats import percentile
from server.turn_model import EndOfTurnQueue, SmartTurn


def _pct(xs: list[float], q: float) -> int | None:
    p = percentile(xs, q)
    return None if p is None else round(p)


async def _vad_load(streams: int, stop: asyncio.Event) -> int:
    """`streams` sessions' audio through the served VAD batcher, one 32 ms window each every 32 ms."""
    from server.vad import VAD_WINDOW, VadBatcher

    batcher = VadBatcher()
    await batcher.ready()
    rng = np.random.default_rng(1)
    window = (rng.standard_normal(VAD_WINDOW) * 0.1).astype(np.float32)[None]  # [1, 512]
    windows = 0

    async def one(k: int) -> None:
        nonlocal windows
        stream, t = batcher.stream(), time.perf_counter() + k * 0.032 / streams
        while not stop.is_set():
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            await stream.probs(window)
            windows += 1
            t += 0.032

    await asyncio.gather(*(one(k) for k in range(streams)))
    return windows


async def run(gap_s: float, questions: int, threads: int, vad_streams: int = 0) -> dict[str, float]:
    rng = random.Random(0)
    model = SmartTurn(threads=threads)
    calls: list[float] = []  # the model's own time of each question it ran (ms)

    def observe(outcome: str, wait_s: float | None, call_s: float | None) -> None:
        if call_s is not None:
            calls.append(call_s * 1e3)

    queue = EndOfTurnQueue(load=lambda: model, observe=observe)
    await queue.ready()
    stop = asyncio.Event()
    vad = asyncio.ensure_future(_vad_load(vad_streams, stop)) if vad_streams else None
    turns = [np.random.default_rng(i).standard_normal(16000 * 6).astype(np.float32) * 0.1 for i in range(4)]
    arrivals = []
    for k in range(questions):
        at = k * gap_s + rng.uniform(0, 0.02)
        if rng.random() < 0.3:
            at = round(at / 0.25) * 0.25
        arrivals.append((at, k, 0.15 if rng.random() < 0.6 else None))
    arrivals.sort()
    waits: list[float] = []

    async def ask(k: int, withdraw_after: float | None) -> int:
        t = time.perf_counter()
        answer = asyncio.ensure_future(queue.complete(turns[k % len(turns)]))
        await asyncio.wait({answer}, timeout=withdraw_after)
        if not answer.done():
            answer.cancel()
            return 1
        waits.append((time.perf_counter() - t) * 1e3)
        return 0

    t0, asked = time.perf_counter(), []
    for at, k, withdraw_after in arrivals:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        asked.append(asyncio.ensure_future(ask(k, withdraw_after)))
    withdrawn = sum(await asyncio.gather(*asked))
    result = {"questions": questions, "answered": len(waits), "withdrawn_unanswered": withdrawn,
              "wait_p50_ms": _pct(waits, 50), "wait_p95_ms": _pct(waits, 95), "wait_max_ms": _pct(waits, 100),
              "call_p50_ms": _pct(calls, 50), "call_p95_ms": _pct(calls, 95)}
    if vad is not None:
        stop.set()
        result["vad_windows_per_s"] = round(await vad / (time.perf_counter() - t0))
    return result


def _process(args: argparse.Namespace) -> dict[str, float]:
    if not args.default_pools:
        from server.vad import one_thread_pools

        one_thread_pools()
    return asyncio.run(run(args.gap_ms / 1e3, args.questions, args.threads, args.vad_streams))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gap-ms", type=float, default=35.0, help="mean time between questions (default 35)")
    ap.add_argument("--questions", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1, help="the model's threads (default 1)")
    ap.add_argument("--vad-streams", type=int, default=0, help="sessions' audio classified meanwhile (default 0)")
    ap.add_argument("--default-pools", action="store_true", help="torch and BLAS at their own thread counts")
    ap.add_argument("--processes", type=int, default=1, help="such processes at once (default 1)")
    args = ap.parse_args()
    if args.processes == 1:
        print(_process(args))
        return
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        for result in pool.map(_process, [args] * args.processes):
            print(result)


if __name__ == "__main__":
    main()
