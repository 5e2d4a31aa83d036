"""`moss-speech bench refill` on the tiny model (CPU): the re-prefill's time alone and beside decoding answers, and
their step times before and during it."""

import argparse
import json
import subprocess
import sys

from moss_speech.commands.bench_refill import add_arguments, engine_config


def test_bench_refill_reports_the_refill_and_the_answers_step_times(tmp_path):
    out = tmp_path / "refill.json"
    r = subprocess.run([sys.executable, "-m", "moss_speech.cli", "bench", "refill", "--model", "tiny-random",
                        "--device", "cpu", "--rows", "40", "--sessions", "1", "--context", "16", "--steps", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["rows"] == 40 and res["refill_alone_ms"] > 0 and res["refill_beside_answers_ms"] > 0
    assert res["steps_during_refill"] >= 1
    steps = res["answer_step_ms"]
    assert 0 < steps["before_p50"] <= steps["before_p95"] and 0 < steps["during_p50"] <= steps["during_p95"]


def test_the_pool_holds_the_answers_and_one_refill_not_every_answer_at_the_refills_size():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "full-random", "--device", "cpu", "--rows", "6000", "--sessions", "64"])
    config = engine_config(args)
    assert config.max_model_len >= 6000 + 16
    assert config.kv_cache_bytes < 80 * 2**30  # beside 17 GiB of weights on a 141 GB GPU (the old sizing: 124 GiB)
