"""`moss-speech bench encoder` on the tiny codec (CPU): every batch's time and its host / GPU-wait split reported."""

import json
import subprocess
import sys


def test_bench_encoder_reports_each_batch_with_its_host_split(tmp_path):
    out = tmp_path / "enc.json"
    r = subprocess.run([sys.executable, "-m", "moss_speech.cli", "bench", "encoder", "--codec", "tiny-random",
                        "--device", "cpu", "--batches", "1,3", "--iters", "3", "--context-s", "0.4",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    for key in ("ms_per_80ms", "cpu_ms", "gpu_wait_ms"):
        assert set(res[key]) == {"1", "3"}, key
    for b in ("1", "3"):
        assert res["ms_per_80ms"][b] > 0
        assert res["cpu_ms"][b] > 0  # the step's framing, plan and forward run on this thread
        assert 0 <= res["gpu_wait_ms"][b] <= res["ms_per_80ms"][b]  # a part of each step (on a CPU: nothing to wait)
    assert r.stdout.count("its thread's CPU") == 2


def test_bench_encoder_times_each_step_once(monkeypatch, tmp_path):
    """Wall time, CPU time and GPU wait come from the same steps: a batch runs its context, one warm-up step and
    --iters timed steps (it once ran the timed steps twice, a second time for the host split)."""
    import argparse

    from moss_speech.commands import bench_encoder

    steps = []
    warm = bench_encoder.warm_streams

    def counted(*a, **kw):
        step, streams = warm(*a, **kw)
        steps.append(0)

        def counting() -> None:
            steps[-1] += 1
            step()

        return counting, streams

    monkeypatch.setattr(bench_encoder, "warm_streams", counted)
    p = argparse.ArgumentParser()
    bench_encoder.add_arguments(p)
    args = p.parse_args(["--codec", "tiny-random", "--device", "cpu", "--batches", "1,2", "--iters", "4",
                         "--context-s", "0.2", "--json", str(tmp_path / "enc.json")])
    assert bench_encoder.run(args) == 0
    assert steps == [5, 5]
    assert set(json.loads((tmp_path / "enc.json").read_text())["cpu_ms"]) == {"1", "2"}
