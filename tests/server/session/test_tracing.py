"""GA `tracing` (the OpenAI Agents SDK sends "auto" on every session): taken and shown, fixed once set as OpenAI's
is, and, there being no trace dashboard, named in the session's log where an operator can find the trace's
sessions."""

from __future__ import annotations

import logging

import pytest

from tests.server.session.session_support import drain, new_session
from tests.server.strict_events import check


async def _update(s, tracing) -> list:
    await s.handle_client_event({"type": "session.update", "session": {"type": "realtime", "tracing": tracing}})
    return [check(e) for e in drain(s)]


@pytest.mark.parametrize("tracing", ["auto", {"workflow_name": "support-line", "group_id": "g-7",
                                              "metadata": {"customer": "c-42"}}])
async def test_tracing_is_taken_shown_and_logged(tracing, caplog):
    caplog.set_level(logging.INFO, logger="server.session.session")
    s, _ = await new_session()
    evs = await _update(s, tracing)
    assert [e.type for e in evs] == ["session.updated"]
    shown = evs[0].session.tracing
    assert (shown if isinstance(shown, str) else shown.model_dump(exclude_none=True)) == tracing
    logged = [r for r in caplog.records if r.getMessage().startswith("tracing ")]
    assert len(logged) == 1 and logged[0].session_id == s.id
    if isinstance(tracing, dict):
        assert "support-line" in logged[0].getMessage() and "c-42" in logged[0].getMessage()
    assert [e.type for e in await _update(s, tracing)] == ["session.updated"]  # the same again: fine, not logged
    assert len([r for r in caplog.records if r.getMessage().startswith("tracing ")]) == 1


@pytest.mark.parametrize(("first", "then", "param"), [
    ("auto", None, "session.tracing"),  # fixed once set
    (None, {"workflow_name": 7}, "session.tracing.workflow_name"),
    (None, {"metadata": {"k": "v" * 3000}}, "session.tracing.metadata"),
    (None, {"trace_id": "x"}, "session.tracing.trace_id"),
    (None, "on", "session.tracing")])
async def test_tracing_that_cannot_be_taken_is_refused_by_name(first, then, param):
    s, _ = await new_session()
    if first is not None:
        await _update(s, first)
    evs = await _update(s, then)
    assert [e.type for e in evs] == ["error", "session.updated"]
    assert evs[0].error.param == param and evs[1].session.tracing == first
