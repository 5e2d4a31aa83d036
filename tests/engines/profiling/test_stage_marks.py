"""engines/profiling/stage_marks.py, the reader of the engine's per-answer stage marks: its tail line names the
stages that make the slowest turns slow, by the client's TTFA where the server logged it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engines.profiling import stage_marks


def _log(tmp_path: Path, n: int = 20) -> Path:
    """n answers: answer i waits 2 i ms for the encoder worker and its first-chunk round takes 30 ms, except the
    slowest two, whose round takes 60; the server adds 10 ms to each."""
    lines = []
    for i in range(n):
        wait, rnd = 2.0 * i, 60.0 if i >= n - 2 else 30.0
        marks = {"commit_in": -20.0 - wait, "commit_call": -20.0, "commit_encoded": -5.0, "first_row": 10.0,
                 "first_chunk_codes": 40.0, "codec_first_round_start": 41.0, "codec_first_round_end": 41.0 + rnd,
                 "first_audio": 42.0 + rnd}
        ttfa = marks["first_audio"]
        lines.append(f"INFO engine: response r{i}: first audio at {ttfa:.1f} ms; stages {marks}")
        client = ttfa - marks["commit_in"] + 10
        lines.append(f"INFO server: response done id=r{i} status=completed reason=x ttfa_ms={client:.1f}")
    lines.append("INFO engine: response warm-up-1: first audio at 1.0 ms; stages {'first_audio': 1.0}")
    path = tmp_path / "server.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_tail_line_names_the_stages_of_the_slowest_turns(tmp_path, capsys):
    answers = stage_marks.read(str(_log(tmp_path)))
    assert len(answers) == 20 and all("server_ttfa" in d for _, d in answers)  # the warm-up left out
    line = stage_marks.tail(answers)
    # slowest two (i = 18, 19): waits 36, 38, rounds 60, client TTFA 168, 170; middle 40% (i = 6..13): waits 12..26,
    # rounds 30, client TTFA 114..128
    assert "commit -> its call +18;" in line and "first-chunk round +30;" in line and "its call +0;" in line
    assert line.startswith("tail (worst 10% of turns against the middle 40%, mean ms): TTFA 169 against 121")
    stage_marks.main([str(tmp_path / "server.log"), "10"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("10 sessions (20 answers): engine TTFA") and out[2] == f"10 sessions {line}"
    assert out[3] == f"10 sessions {stage_marks.cut(answers)}"


def test_too_few_answers_for_a_tail():
    assert stage_marks.tail([(1.0, {})] * 9) == "tail: too few answers"
    assert stage_marks.cut([(1.0, {})] * 9) == "cut: too few answers"


def test_the_cut_line_is_the_p95_without_one_stages_tail(tmp_path):
    """Client TTFA of answer i is 102 + 2 i (+30 for the slowest two): p95 over 20 answers interpolates between
    answers 18 and 19. Cutting the worker wait (2 i, median 19) to its median leaves 121 for i >= 10, +30 for the
    last two; cutting the round's tail (median 30) leaves 102 + 2 i; its own call never varies."""
    line = stage_marks.cut(stage_marks.read(str(_log(tmp_path))))
    ttfa = [102 + 2 * i + (30 if i >= 18 else 0) for i in range(20)]
    p95 = lambda xs: float(np.percentile(xs, 95))  # noqa: E731
    no_wait = [t - max(0, 2 * i - 19) for i, t in enumerate(ttfa)]
    no_round = [102 + 2 * i for i in range(20)]
    assert line.startswith(f"p95 were one stage's tail cut to its median (ms): TTFA {p95(ttfa):.0f}; ")
    assert f"; commit -> its call {p95(no_wait):.0f};" in line and f"; first-chunk round {p95(no_round):.0f};" in line
    assert f"; its call {p95(ttfa):.0f};" in line


@pytest.mark.parametrize("worst", [0.1, 0.2])
def test_the_tail_is_taken_by_client_ttfa(tmp_path, worst):
    """The order is the server's TTFA: with the engine's reversed, the same turns are the slow ones."""
    answers = [(100.0 - t, d) for t, d in stage_marks.read(str(_log(tmp_path)))]
    assert "commit -> its call +" in stage_marks.tail(answers, worst=worst)
    assert stage_marks.tail(answers, worst=worst) == stage_marks.tail(stage_marks.read(str(_log(tmp_path))),
                                                                      worst=worst)


def test_a_gzipped_log_reads_as_the_plain_one(tmp_path):
    """The pair script keeps each run's log gzipped (server-<label>-<n>.log.gz): read as it is."""
    import gzip

    plain = _log(tmp_path)
    packed = tmp_path / "server-A-1.log.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    answers = stage_marks.read(str(packed))
    assert len(answers) == 20 and answers == stage_marks.read(str(plain))


def test_its_help_and_a_level_of_no_sessions_are_usage_not_a_log_read(capsys):
    with pytest.raises(SystemExit) as out:
        stage_marks.main(["--help"])
    assert out.value.code == 0 and "each load level's sessions" in capsys.readouterr().out
    with pytest.raises(SystemExit) as out:
        stage_marks.main(["server.log", "0"])
    assert out.value.code == 2 and "must be >= 1" in capsys.readouterr().err
