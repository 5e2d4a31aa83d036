"""The engine process's load log (observe/load_log.py): rows per model step, steps not launched ahead and why, and
the codec's solves."""

from __future__ import annotations

import logging
import re

import pytest

from engines.api import step_row_labels
from engines.lm.scheduler import AHEAD_REFUSALS
from engines.process.observe import load_log
from engines.process.observe.load_log import solves
from engines.speech_out.decoder import SolveCounts
from tests.engines.process.tiny_engine import served, text_turns


def test_load_log_reports_rows_per_model_step(monkeypatch, caplog) -> None:
    monkeypatch.setattr(load_log, "LOAD_LOG_S", 0.0)  # a line after every loop step
    server, ctx = served()
    try:
        with caplog.at_level(logging.INFO, logger="engines.process"):
            text_turns(server, ctx, sessions=3)
        steps = decoded = prompt = 0.0
        by_rows: dict[str, list[int]] = {}  # bucket label -> [steps, rows]
        refused: dict[str, list[int]] = {}  # why -> [steps, of them while an answer ramped]
        for r in caplog.records:
            if (x := re.search(r"; not launched ahead: ([^;]*)", r.getMessage())) is not None:
                for why, n, ramping in re.findall(r"([a-z ,]+?) (\d+) \((\d+) ramping\)(?:, |$)", x.group(1)):
                    c = refused.setdefault(why, [0, 0])
                    c[0], c[1] = c[0] + int(n), c[1] + int(ramping)
            x = re.search(r"; (\d+) model steps \(\d+ launched ahead\) of ([\d.]+) decode \+ ([\d.]+) prompt rows",
                          r.getMessage())
            if x:
                n = int(x.group(1))
                steps, decoded, prompt = steps + n, decoded + n * float(x.group(2)), prompt + n * float(x.group(3))
            for label, n, rows in re.findall(r"([\d>-]+): (\d+) \((\d+) rows\)", r.getMessage()):
                b = by_rows.setdefault(label, [0, 0])
                b[0], b[1] = b[0] + int(n), b[1] + int(rows)
        st = server.service.engine.stats()
        assert steps == st.steps > 0
        # Every step in its row bucket once: the prompts' steps (more rows) apart from the decode steps (one row each)
        want = {label: [n, rows] for label, n, rows in zip(step_row_labels(), st.step_row_counts, st.step_row_sums,
                                                          strict=True) if n}
        assert by_rows == want and sum(n for n, _ in want.values()) == st.steps
        assert len(want) >= 2 and sum(rows for _, rows in want.values()) >= st.decoded_rows + st.prefilled_rows
        assert decoded == pytest.approx(st.decoded_rows, abs=0.01 * steps) and st.decoded_rows > 0
        assert prompt == pytest.approx(st.prefilled_rows, abs=0.01 * steps) and st.prefilled_rows > 0
        # Steps the next was not launched ahead of, by why: text answers' rows are decided on the host
        assert refused and refused == {why: [n, st.ahead_refused_ramping.get(why, 0)]
                                       for why, n in st.ahead_refused.items()}
        assert set(refused) <= set(AHEAD_REFUSALS)
    finally:
        server.close()
        ctx.term()


def test_load_log_names_the_codec_solves_and_their_padding():
    """The load log's codec solves: per kind of round, the decoders' counts since the last log (then reset)."""

    class Dec:
        def __init__(self, *counts):
            self.counts = SolveCounts(*counts)

        def take_counts(self):
            c, self.counts = self.counts, SolveCounts()
            return c

    lanes = [Dec(3, 0, 4, 4), Dec(1, 1, 2, 2)]
    assert solves("first-chunk", lanes) == "; first-chunk solves 4 (1 partial) of 1.5 sessions as 1.5 rows"
    assert solves("first-chunk", lanes) == ""  # taken
    assert solves("playing", [Dec(2, 0, 66, 80)]) == "; playing solves 2 (0 partial) of 33.0 sessions as 40.0 rows"
    assert solves("playing", [object()]) == ""  # a decoder without counts (a test's fake)
