"""engines/profiling/pair_compare.py: an A/B pair's server logs pooled per label, and B's p95 shift with its
interval."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from engines.profiling import pair_compare


def _write(path: Path, ttfas: np.ndarray) -> None:
    lines = ["INFO engine: response warm-up-1: first audio at 1.0 ms; stages {}"]
    lines += [f"ts=x level=info logger=server.session.session msg=\"response done id=r{i} status=completed reason=x "
              f"ttfa_ms={t:.3f} audio_s=1.0\"" for i, t in enumerate(ttfas)]
    text = "\n".join(lines) + "\n"
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


def test_labels_pool_their_runs_and_the_shift_is_found(tmp_path, capsys):
    rng = np.random.default_rng(1)
    a1, a2 = rng.normal(120, 30, 512), rng.normal(120, 30, 512)
    b1, b2 = a1 + 20, a2 + 20  # B is A 20 ms later, turn for turn
    _write(tmp_path / "server-A-1.log.gz", a1)
    _write(tmp_path / "server-B-2.log.gz", b1)
    _write(tmp_path / "server-B-3.log", b2)
    _write(tmp_path / "server-A-4.log.gz", a2)
    (tmp_path / "capacity-A-1.json").write_text("{}")  # not a log: left out of a directory's search
    groups = pair_compare.runs_by_label([str(tmp_path)])
    assert list(groups) == ["A", "B"] and [len(r) for r in groups.values()] == [2, 2]
    pooled_a = np.concatenate([a1, a2])
    assert np.allclose(np.concatenate([t for _, t in groups["A"]]), pooled_a, atol=1e-3)
    d, lo, hi = pair_compare.p95_shift([a1, a2], [b1, b2])
    assert d == pytest.approx(20.0) and lo < 20.0 < hi and hi - lo < 20.0
    pair_compare.main([str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"A: 2 run(s), 1024 turns: p50 {np.percentile(pooled_a, 50):.0f} / "
                      f"p95 {np.percentile(pooled_a, 95):.0f} ms (runs' p95: {np.percentile(a1, 95):.0f}, "
                      f"{np.percentile(a2, 95):.0f})")
    assert out[2].startswith("B - A: p95 +20.0 ms [")


def test_a_label_of_no_difference_gets_an_interval_around_zero():
    rng = np.random.default_rng(2)
    runs = [rng.normal(120, 30, 512) for _ in range(4)]
    d, lo, hi = pair_compare.p95_shift(runs[:2], runs[2:])
    assert lo < 0.0 < hi and lo <= d <= hi


def test_bad_inputs_are_named(tmp_path):
    odd = tmp_path / "server.log"
    odd.write_text("x\n")
    with pytest.raises(SystemExit, match="not a pair's server log"):
        pair_compare.runs_by_label([str(odd)])
    quiet = tmp_path / "server-A-1.log"
    quiet.write_text("INFO engine: nothing at info\n")
    with pytest.raises(SystemExit, match="no server TTFA lines"):
        pair_compare.runs_by_label([str(quiet)])
