"""engines.cuda.streams.side_by_side's fork and join order, on fake streams (CPU: the GPU users are in tests/gpu)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engines.cuda.streams import side_by_side


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self.name, other.name))


@pytest.fixture
def streams(monkeypatch):
    log: list = []
    current = [FakeStream("main", log)]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)

    def branch(value):
        def fn():
            log.append(("run", value, current[-1].name))
            return value
        return fn

    return log, [FakeStream(f"s{i}", log) for i in range(3)], branch


def test_branches_fork_after_the_current_stream_and_join_before_its_next_work(streams):
    log, (s0, s1, s2), branch = streams
    assert side_by_side([s0, s1, s2], branch("a"), branch("b"), branch("c")) == ["a", "b", "c"]
    assert log == [("wait", "s0", "main"), ("run", "b", "s0"), ("wait", "s1", "main"), ("run", "c", "s1"),
                   ("run", "a", "main"), ("wait", "main", "s0"), ("wait", "main", "s1")]  # s2 unused, untouched


def test_more_branches_than_streams_is_refused(streams):
    _, (s0, _, _), branch = streams
    with pytest.raises(ValueError, match="2 branches for 1 streams"):
        side_by_side([s0], branch("a"), branch("b"), branch("c"))
