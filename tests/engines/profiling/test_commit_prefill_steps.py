"""The committed-turn prefill profiler counts the scheduler's steps: the ramp cap shows in them."""

from __future__ import annotations

import pytest

from engines.profiling.commit_prefill_steps import main, steps_to_first_row


def test_a_ramp_cap_spreads_a_committed_turns_prefill_over_more_steps():
    capped = steps_to_first_row(24, answers=8, turn_rows=130, every=5, turns=4)
    uncapped = steps_to_first_row(0, answers=8, turn_rows=130, every=5, turns=4)
    assert len(capped) == len(uncapped) == 4
    assert max(uncapped) <= 2  # the whole turn in one step (its first row read a step later)
    # a turn that arrives while another answer ramps gets ~16 rows a step; one that arrives when none does, all
    assert max(capped) >= 130 // 16 and sum(capped) > sum(uncapped)


def test_the_command_reports_and_refuses_nonsense(capsys):
    main(["--answers", "4", "--turns", "2", "--every", "3"])
    assert "steps to its first row p50" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--every", "0"])
