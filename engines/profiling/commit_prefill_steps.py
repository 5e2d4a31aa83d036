"""How many engine steps a committed turn's prefill takes beside decoding answers, with the scheduler's ramp cap.

    python3 -m engines.profiling.commit_prefill_steps [--ramp-step-rows 64] [--answers 100] [--turn-rows 130]
        [--every 5] [--turns 40]

`--answers` sequences decode audio throughout; every `--every` steps a turn of `--turn-rows` rows arrives whole (a
commit whose rows the engine prefills again: the whole-segment floor changed most of a 10 s turn's ~130 codes) and
asks for a short answer, whose first rows ramp. Reported: the steps from each turn's arrival to its first generated
row, p50 and p95. Step counts are the scheduler's decisions and do not depend on the device (the tiny model runs on
the CPU); what a step costs does (docs/performance.md).
"""

from __future__ import annotations

import argparse
import random

from engines.config import EngineConfig, model_config_for
from engines.lm.engine import Engine
from moss_speech.commands.bench_engine import _audio_forever, _rows, start_decode_batch
from moss_speech.loadtest.stats import percentile


def steps_to_first_row(ramp_step_rows: int, answers: int, turn_rows: int, every: int, turns: int,
                       model: str = "tiny-random") -> list[int]:
    """Each turn's steps from its arrival to its first generated row, in arrival order."""
    mc = model_config_for(model)
    cfg = EngineConfig(device="cpu", dtype="float32", max_running=answers + turns, max_model_len=4096,
                       kv_cache_bytes=mc.kv_bytes_per_row() * (answers * 3200 + turns * (turn_rows + 64) + 4096),
                       ramp_step_rows=ramp_step_rows, cuda_graphs=False)
    engine = Engine.from_name(model, cfg)
    rng = random.Random(0)
    start_decode_batch(engine, rng, answers, 64, 3000)
    arrived: dict[str, int] = {}
    waited: dict[str, int] = {}
    step = 0
    while len(waited) < turns:
        if len(arrived) < turns and step % every == 0:
            name = f"turn{len(arrived)}"
            engine.add_request(name, _rows(rng, turn_rows), _audio_forever(20, seed=len(arrived)))
            arrived[name] = step
        engine.step()
        step += 1
        for name, at in arrived.items():
            seq = engine.live_request(name)
            if name not in waited and seq is not None and seq.num_generated > 0:
                waited[name] = step - at
        if step > 100 * turns * every:
            late = sorted(set(arrived) - set(waited))
            raise RuntimeError(f"turns still without a first row after {step} steps: {late}")
    return [waited[name] for name in arrived]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m engines.profiling.commit_prefill_steps",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--ramp-step-rows", type=int, default=EngineConfig().ramp_step_rows)
    ap.add_argument("--answers", type=int, default=100, help="answers decoding throughout (default 100)")
    ap.add_argument("--turn-rows", type=int, default=130, help="rows each committed turn prefills (default 130)")
    ap.add_argument("--every", type=int, default=5, help="steps between two turns' arrivals (default 5)")
    ap.add_argument("--turns", type=int, default=40, help="turns (default 40)")
    args = ap.parse_args(argv)
    for name in ("answers", "turn_rows", "every", "turns"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.ramp_step_rows < 0:
        ap.error("--ramp-step-rows must be >= 0 (0: no cap)")
    waited = steps_to_first_row(args.ramp_step_rows, args.answers, args.turn_rows, args.every, args.turns)
    print(f"ramp cap {args.ramp_step_rows} rows, {args.answers} answers decoding, a {args.turn_rows}-row turn every "
          f"{args.every} steps: steps to its first row p50 {percentile(waited, 50):g}, p95 {percentile(waited, 95):g}, "
          f"max {max(waited)} ({len(waited)} turns)")


if __name__ == "__main__":
    main()
