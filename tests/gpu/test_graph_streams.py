"""Graph capture streams: every graph owner captures on a stream of its own, outside PyTorch's stream pool, so no
two owners' graphs (nor a graph and eager work) share a cuBLAS workspace while they run at the same time."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_private_streams_are_not_pool_streams():
    from engines.graphs import private_stream

    mine = [private_stream() for _ in range(3)]
    lo, hi = torch.cuda.Stream.priority_range()
    # More than the pool's 32 streams per priority: every pool stream comes back at least once.
    pool = [torch.cuda.Stream(priority=p).cuda_stream for p in (lo, hi) for _ in range(70)]
    handles = [s.cuda_stream for s in mine]
    assert len(set(handles)) == 3
    assert not set(handles) & set(pool)
    assert len(set(pool)) < len(pool)  # (the pool does hand out the same streams again)
    x = torch.randn(64, 64, device="cuda")
    with torch.cuda.stream(mine[0]):
        y = x @ x
    torch.cuda.current_stream().wait_stream(mine[0])
    torch.testing.assert_close(y, x @ x)


def test_graphs_of_two_owners_replayed_at_once_match_eager():
    """The server's case: one owner's graphs replay on its stream while another owner's replay on another, with
    split-K-prone GEMM shapes; every output equals the eager one and the replays finish."""
    from engines.bench.workspace_race import race

    got = race("private", rounds=150, timeout_s=60.0)
    assert got["finished"], got
    assert got["mismatched_outputs"] == 0, got


def test_private_stream_from_a_new_thread():
    """The codec worker captures graphs it meets while serving on its own thread: a private stream made there
    (no CUDA call on that thread before) works."""
    import threading

    from engines.graphs import private_stream

    x = torch.randn(128, 128, device="cuda")
    want = x @ x
    got: dict = {}

    def worker():
        try:
            s = private_stream(x.device)
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                got["y"] = x @ x
            s.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert "error" not in got, got.get("error")
    torch.testing.assert_close(got["y"], want)
