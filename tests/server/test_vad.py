"""The shared, batched VAD: every session's windows in one call per round, each session's own state.

Reference: the silero-vad package's own wrapper, one model per stream, one window at a time (what the
server ran before). Batched and alone differ only in the LSTM's matmul blocking: ~1e-8 in probability
here; the tolerance below is 1e-5, far under any threshold a turn could turn on.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from server.audio.pcm import read_wav
from server.vad import VAD_RATE, VAD_WINDOW, VadBatcher, load_silero_16k
from tests.paths import DATA, REPO

WAV = DATA / "speech_en_16k.wav"
TOL = 1e-5


@pytest.fixture(scope="module")
def speech16k() -> np.ndarray:
    x, rate = read_wav(WAV, target_rate=VAD_RATE)
    assert rate == VAD_RATE
    return x


def reference_probs(pcm: np.ndarray) -> list[float]:
    """The package's wrapper on one stream, window by window (its state carries across calls)."""
    from silero_vad import load_silero_vad

    with warnings.catch_warnings():  # the package's own deprecation noise on load
        warnings.simplefilter("ignore", DeprecationWarning)
        model = load_silero_vad()
    with torch.inference_mode():
        return [float(model(torch.from_numpy(w.copy()), VAD_RATE)) for w in pcm.reshape(-1, VAD_WINDOW)]


def streams_audio(speech: np.ndarray, n: int) -> list[np.ndarray]:
    """n different streams: the sample shifted, scaled and with leading silence, whole windows long."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        lead = np.zeros(VAD_WINDOW * (i % 5), np.float32)
        x = np.concatenate([lead, np.roll(speech, 3000 * i) * (0.3 + 0.1 * (i % 7))])
        x = x + rng.normal(0, 1e-3, len(x)).astype(np.float32)
        out.append(x[: len(x) // VAD_WINDOW * VAD_WINDOW].astype(np.float32))
    return out


class CountingNet:
    """Wraps the real network and records each call's batch size."""

    def __init__(self) -> None:
        self.net = load_silero_16k()
        self.batches: list[int] = []

    def __call__(self, x: torch.Tensor, state: torch.Tensor):  # noqa: ANN204
        self.batches.append(x.shape[0])
        return self.net(x, state)


async def test_batched_sessions_equal_each_alone_and_share_calls(speech16k):
    streams_pcm = streams_audio(speech16k, 12)
    counting = CountingNet()
    batcher = VadBatcher(load=lambda: counting)
    streams = [batcher.stream() for _ in streams_pcm]
    await streams[0].ready()
    got: list[list[float]] = [[] for _ in streams]

    async def user(i: int) -> None:
        # Pieces of 1-3 windows, different per user, so rounds mix requests of different lengths.
        pcm, pos, k = streams_pcm[i], 0, i
        while pos < len(pcm):
            n = 1 + k % 3
            k += 1
            got[i] += await streams[i].probs(pcm[pos:pos + n * VAD_WINDOW].reshape(-1, VAD_WINDOW))
            pos += n * VAD_WINDOW
            await asyncio.sleep(0)

    await asyncio.gather(*(user(i) for i in range(len(streams))))
    for i, pcm in enumerate(streams_pcm):
        ref = reference_probs(pcm)
        assert len(got[i]) == len(ref)
        assert np.max(np.abs(np.array(got[i]) - np.array(ref))) < TOL, i
        assert max(ref) > 0.5  # the stream has speech: the comparison covers both sides of the threshold
    windows = sum(len(p) // VAD_WINDOW for p in streams_pcm)
    assert sum(counting.batches) == windows
    assert max(counting.batches) == len(streams)  # the users' windows went in shared calls
    assert len(counting.batches) < windows / 4


async def test_one_streams_requests_keep_their_order(speech16k):
    pcm = speech16k[: 12 * VAD_WINDOW].reshape(-1, VAD_WINDOW)
    s = VadBatcher().stream()
    # Queued at once: they must not share a round (the second needs the state the first leaves).
    a, b, c = await asyncio.gather(s.probs(pcm[:5]), s.probs(pcm[5:6]), s.probs(pcm[6:]))
    ref = reference_probs(pcm.reshape(-1))
    assert np.max(np.abs(np.array(a + b + c) - np.array(ref))) < TOL


async def test_reset_starts_the_stream_afresh_even_with_windows_in_flight(speech16k):
    pcm = speech16k[: 8 * VAD_WINDOW].reshape(-1, VAD_WINDOW)
    batcher = VadBatcher()
    s = batcher.stream()
    await s.probs(pcm[:4])
    pending = asyncio.ensure_future(s.probs(pcm[:4]))
    await asyncio.sleep(0)  # queued (or in its round) ...
    s.reset()  # ... when the session resets its VAD: that round's state must not be kept
    await pending
    after = await s.probs(pcm[4:])
    fresh = await batcher.stream().probs(pcm[4:])
    assert after == fresh


async def test_bad_window_shape_is_refused():
    s = VadBatcher().stream()
    with pytest.raises(ValueError, match=r"\[n, 512\]"):
        await s.probs(np.zeros((2, 256), np.float32))
    with pytest.raises(ValueError, match=r"\[n, 512\]"):
        await s.probs(np.zeros(512, np.float32))


async def test_a_failing_round_fails_its_sessions_and_the_batcher_goes_on(speech16k):
    real = load_silero_16k()
    calls = {"n": 0}

    def flaky(x: torch.Tensor, state: torch.Tensor):  # noqa: ANN202
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(x, state)

    batcher = VadBatcher(load=lambda: flaky)
    s1, s2 = batcher.stream(), batcher.stream()
    w = speech16k[:VAD_WINDOW].reshape(1, VAD_WINDOW)
    results = await asyncio.gather(s1.probs(w), s2.probs(w), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) and "boom" in str(r) for r in results)
    ok = await s1.probs(w)  # state untouched by the failed round: same as a fresh stream's first window
    assert ok == await batcher.stream().probs(w)


async def test_a_cancelled_session_does_not_hold_up_the_others(speech16k):
    batcher = VadBatcher()
    s1, s2 = batcher.stream(), batcher.stream()
    w = speech16k[: 2 * VAD_WINDOW].reshape(2, VAD_WINDOW)
    t1 = asyncio.ensure_future(s1.probs(w))
    t2 = asyncio.ensure_future(s2.probs(w))
    t1.cancel()
    assert len(await t2) == 2
    with pytest.raises(asyncio.CancelledError):
        await t1
    assert len(await s1.probs(w)) == 2


async def test_waiters_of_a_stopped_batcher_get_an_error_not_a_hang(speech16k):
    batcher = VadBatcher(round_every_s=60.0)
    s = batcher.stream()
    w = speech16k[:VAD_WINDOW].reshape(1, VAD_WINDOW)
    await s.probs(w)  # the first round runs at once; the next one not for 60 s
    stuck = asyncio.ensure_future(s.probs(w))
    await asyncio.sleep(0.01)
    assert not stuck.done()
    batcher._task.cancel()  # the runner dies (as it would on an unexpected error)
    await asyncio.sleep(0)
    later = asyncio.ensure_future(batcher.stream().probs(w))  # the next request finds it dead
    with pytest.raises(RuntimeError, match="VAD batcher stopped"):
        await asyncio.wait_for(stuck, 5)  # and the dead runner's waiter is told
    later.cancel()


def _in_a_process_of_its_own(code: str) -> object:
    """What `code` prints last, as JSON: process-wide settings stay out of the test process (its cores are the
    tests')."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=REPO)  # (the repository's packages, tests included, importable whatever the runner's cwd)
    return json.loads(out.stdout.strip().splitlines()[-1])


_POOLS = ("import json, torch, threadpoolctl; print(json.dumps([torch.get_num_threads(), [p['num_threads'] for p in "
          "threadpoolctl.threadpool_info() if p['user_api'] == 'blas']]))")


def test_one_thread_pools_sets_torch_and_every_blas_pool_to_one_thread():
    torch_threads, blas = _in_a_process_of_its_own(f"from server.vad import one_thread_pools; one_thread_pools(); "
                                                   f"{_POOLS}")
    assert torch_threads == 1
    assert blas and set(blas) == {1}  # numpy's BLAS at least, loaded and limited


@pytest.mark.parametrize("own_process", [True, False])
def test_a_serving_apps_vad_sets_its_process_pools_and_no_other_app_does(own_process):
    before = _in_a_process_of_its_own(_POOLS)
    # loaded in a worker thread, as the app preloads it; the pools read in another thread, as the VAD's calls run
    setup = ("import threading; from server.vad_streams import VadStreams; from server.ops.metrics import Metrics; "
             "from tests.fakes.harness import tiny_settings; "
             f"vad = VadStreams(tiny_settings(), Metrics(), own_process={own_process}); "
             "t = threading.Thread(target=vad.batcher); t.start(); t.join(); ")
    after = _in_a_process_of_its_own(setup + _POOLS)
    if own_process:
        assert after[0] == 1 and set(after[1]) == {1}
    else:  # e.g. a test process, whose engine keeps its threads
        assert after == before


def test_a_serving_app_without_a_vad_never_imports_torch():
    code = ("import json, sys; from server.app import create_app; from tests.fakes.harness import tiny_settings; "
            "create_app(tiny_settings(vad=False), own_process=True); print(json.dumps('torch' in sys.modules))")
    assert _in_a_process_of_its_own(code) is False
