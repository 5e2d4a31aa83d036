"""The committed-turn prefill profiler counts the scheduler's steps: a committed turn's prefill is outside the ramp
cap, so the cap does not spread it."""

from __future__ import annotations

import pytest

from engines.profiling.commit_prefill_steps import main, steps_to_first_row


def test_the_ramp_cap_does_not_spread_a_committed_turns_prefill():
    capped = steps_to_first_row(24, answers=8, turn_rows=130, every=5, turns=4)
    uncapped = steps_to_first_row(0, answers=8, turn_rows=130, every=5, turns=4)
    assert len(capped) == len(uncapped) == 4
    assert max(uncapped) <= 2  # the whole turn in one step (its first row read a step later)
    # While another answer ramps, only the turn's admission step is capped (at least RAMP_MIN_PREFILL rows); the rest
    # of its rows go in the next step, outside the cap (inside it they would take 130 / 16 steps).
    assert max(capped) <= 3


def test_the_command_reports_and_refuses_nonsense(capsys):
    main(["--answers", "4", "--turns", "2", "--every", "3"])
    assert "steps to its first row p50" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--every", "0"])
