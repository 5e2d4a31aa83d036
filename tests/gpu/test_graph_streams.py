"""Graph capture streams: every graph owner captures on a stream of its own, outside PyTorch's stream pool, so no
two owners' graphs (nor a graph and eager work) share a cuBLAS workspace while they run at the same time."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from engines.lm.step_graphs import capture_graph, private_stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_private_streams_are_not_pool_streams():
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


# Skinny GEMMs of the kinds that run beside each other in the server (decode batches of the language model, codec
# chunks): few output tiles over a long K, where cuBLAS splits K and reduces through its workspace.
SKINNY_SHAPES = ((56, 4096, 4096), (64, 1024, 14336), (64, 512, 16384), (128, 256, 8192))


def test_graphs_of_two_owners_replayed_at_once_match_eager():
    """The server's case: one owner's graphs replay on its stream while another owner's replay on another, with
    split-K-prone GEMM shapes; every output equals the eager one and the replays finish. (cuBLAS takes its workspace
    by (handle, stream) and a captured GEMM keeps that address: two owners captured on one stream would share it,
    and their split-K partial sums and semaphores overwrite each other.)"""
    gen = torch.Generator(device="cuda").manual_seed(0)
    owners = [[(torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16),
                torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * scale)
               for m, n, k in SKINNY_SHAPES] for scale in (0.01, 0.02)]
    refs = [[F.linear(x, w) for x, w in mats] for mats in owners]
    graphs = [capture_graph(lambda m=mats: [F.linear(x, w) for x, w in m], private_stream()) for mats in owners]
    torch.cuda.synchronize()
    run_on = [torch.cuda.Stream(), torch.cuda.Stream()]  # no order between them: the two owners' GEMMs overlap
    deadline = time.monotonic() + 60.0
    for _ in range(150):
        for (g, _), s in zip(graphs, run_on, strict=True):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(4):
                    g.replay()
        for s in run_on:
            torch.cuda.current_stream().wait_stream(s)
        end = torch.cuda.Event()
        end.record()
        while not end.query():  # polled: a workspace race can hang the replays, and the test must report it
            assert time.monotonic() < deadline, "the replays did not finish within 60 s"
            time.sleep(0.001)
        for (_, outs), ref in zip(graphs, refs, strict=True):
            for o, r in zip(outs, ref, strict=True):
                torch.testing.assert_close(o, r, rtol=0, atol=1e-2 * float(r.float().abs().max()))


def test_private_stream_from_a_new_thread():
    """The codec worker captures graphs it meets while serving on its own thread: a private stream made there
    (no CUDA call on that thread before) works."""
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


def test_capture_while_another_thread_allocates_and_waits_on_the_gpu():
    """A graph captured while serving (a shape first seen then) runs beside the other threads' work: another thread
    that keeps allocating, launching and waiting for its results (as the engine loop does each step) neither breaks
    the capture nor fails itself, and the captured graphs replay the eager results."""
    stop, errors, steps = threading.Event(), [], [0]

    def busy() -> None:  # the engine loop's pattern: fresh allocations, kernels, then a wait for the result
        try:
            with torch.cuda.stream(private_stream()):
                n = 0
                while not stop.is_set():
                    n = n % 64 + 1
                    # New sizes, so the allocator asks the driver. (Not torch.randn: the default CUDA generator
                    # refuses use outside a capture underway in any thread; the engine's noise is counter-based or
                    # drawn from generators of its own.)
                    a = torch.full((256 + n, 256), 1.0 / n, device="cuda")
                    ev = torch.cuda.Event()
                    (a @ a.T).sum()
                    ev.record()
                    ev.synchronize()
                    float(a[0, 0])  # a copy to the host, as a step's tokens
                    steps[0] += 1
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    x = torch.randn(64, 128, device="cuda")
    ws = [torch.randn(128, 128, device="cuda") / 128 ** 0.5 for _ in range(8)]

    def fn():
        h = x
        for w in ws:
            h = torch.nn.functional.gelu(h @ w)
        return h

    want = fn()
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        while steps[0] < 5 and not errors:  # the other thread is running before the first capture
            time.sleep(0.001)
        stream = private_stream()  # (one for all: they are replayed one at a time)
        graphs = [capture_graph(fn, stream) for _ in range(20)]
    finally:
        stop.set()
        t.join(timeout=30)
    assert not errors, errors
    assert steps[0] > 5
    for g, out in graphs:
        g.replay()
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_private_streams_take_the_priority_asked_or_the_current_streams():
    """A graph's kernels run at its capture stream's priority (engines.lm.step_graphs.private_stream): capture streams
    and
    the side streams forked inside a capture are urgent exactly when asked, or when the stream they are made under
    is."""
    from engines.cuda.streams import high_priority_stream, is_urgent
    from engines.lm.step_graphs import SideStreams, private_stream

    assert is_urgent(private_stream(urgent=True)) and not is_urgent(private_stream(urgent=False))
    assert not is_urgent(private_stream())  # made under the default stream
    side = SideStreams()
    with torch.cuda.stream(high_priority_stream("cuda")):
        assert is_urgent(private_stream()) and not is_urgent(private_stream(urgent=False))
        hi = side.get("cuda", 2)
        assert side.get("cuda", 1) == hi[:1]  # made once per priority
    lo = side.get("cuda", 3)
    assert all(map(is_urgent, hi)) and not any(map(is_urgent, lo)) and len(side.all()) == 5


def test_model_stream_sits_between_the_urgent_and_the_playing_rounds():
    """The model's steps run one level below the commits and first chunks and above the playing rounds; what is made
    under its stream (its graphs' capture streams, their side branches) takes that exact priority."""
    from engines.cuda.streams import high_priority_stream, is_urgent, level, model_stream
    from engines.lm.step_graphs import SideStreams, private_stream

    model, urgent, low = model_stream("cuda"), high_priority_stream("cuda"), private_stream(urgent=False)
    assert level(urgent) < level(model) < level(low) and not is_urgent(model)
    side = SideStreams()
    with torch.cuda.stream(model):
        made = [private_stream(), *side.get("cuda", 2)]
    with torch.cuda.stream(urgent):
        made_urgent = side.get("cuda", 1)
    assert [level(s) for s in made] == [level(model)] * 3
    assert level(made_urgent[0]) == level(urgent) and len(side.all()) == 3
