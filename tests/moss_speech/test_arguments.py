"""The commands' shared argument types: a bad count is a usage error (exit 2) naming the value, not a traceback."""

from __future__ import annotations

import pytest

from moss_speech.cli import main
from moss_speech.commands.arguments import counts, non_negative_int, positive_int


def test_counts_are_comma_separated_whole_numbers_of_at_least_one():
    assert counts("1,16, 64") == [1, 16, 64]
    assert counts("8") == [8]
    for bad in ("0", "1,-4", "1,x", "", "1.5"):
        with pytest.raises(Exception, match="whole number|>= 1"):
            counts(bad)


def test_single_numbers_keep_their_lower_bound():
    assert positive_int("3") == 3 and non_negative_int("0") == 0
    with pytest.raises(Exception, match=">= 1"):
        positive_int("0")
    with pytest.raises(Exception, match=">= 0"):
        non_negative_int("-1")


@pytest.mark.parametrize("argv", [
    ["bench", "codec", "--batches", "0"],
    ["bench", "codec", "--batches", "1,two"],
    ["bench", "codec", "--iters", "0"],
    ["bench", "codec", "--warmup", "-1"],
    ["bench", "encoder", "--batches", "-3"],
    ["bench", "engine", "--batches", "1,,2"],
    ["bench", "sessions", "--sessions", "0"],
    ["bench", "turn", "--sessions", "x"],
])
def test_bench_commands_refuse_bad_counts_as_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err
