"""How long end-of-turn questions wait for the model in one server process (server/turn_model.py, `EndOfTurnQueue`,
the shipped Smart Turn on the CPU), under arrivals shaped like many sessions' pauses: a question every `--gap-ms` on
average, 30% of them falling together on a 250 ms grid (sessions pausing at the same moment), 60% withdrawn if not
answered within 150 ms (the user spoke on: the pause ended). Prints the wait of the answered questions and how many
were withdrawn unanswered. Seeded: the same arrivals every run.

    python3 docs/bench/end_of_turn_queue.py --gap-ms 35    # ~100% of one thread on a 2-core development box
    python3 docs/bench/end_of_turn_queue.py --gap-ms 70    # ~50%
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import numpy as np

from server.turn_model import EndOfTurnQueue, SmartTurn


async def run(gap_s: float, questions: int, threads: int) -> dict[str, float]:
    rng = random.Random(0)
    model = SmartTurn(threads=threads)
    queue = EndOfTurnQueue(load=lambda: model)
    await queue.ready()
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
    waits.sort()
    return {"questions": questions, "answered": len(waits), "withdrawn_unanswered": withdrawn,
            "wait_p50_ms": round(waits[len(waits) // 2]), "wait_p95_ms": round(waits[int(len(waits) * 0.95)]),
            "wait_max_ms": round(waits[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gap-ms", type=float, default=35.0, help="mean time between questions (default 35)")
    ap.add_argument("--questions", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1, help="the model's threads (default 1)")
    args = ap.parse_args()
    print(asyncio.run(run(args.gap_ms / 1e3, args.questions, args.threads)))


if __name__ == "__main__":
    main()
