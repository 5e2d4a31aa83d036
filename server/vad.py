"""Streaming voice activity detection with Silero VAD (the model bundled in the `silero-vad` package).

Silero is stateful across 512-sample windows of 16 kHz audio (32 ms): an LSTM state [2, 1, 128] and the
last 64 samples as context. One model serves every session of the process: each session holds its own
state (`VadStream`), and `VadBatcher` classifies the windows that all sessions have pending in one
batched call per round, in one worker thread. Per session, a window costs ~0.35 ms of CPU alone and
~0.03 ms in a batch of 64 or more, and no executor thread takes the GIL in turn once per
window per session: at a few hundred sessions this is the difference between cores of VAD work and a
fraction of one. Batched and alone agree to ~1e-8 in probability (the same LSTM, a different matmul
blocking), which tests/server/test_vad.py pins.
"""

from __future__ import annotations

import asyncio
import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from server.turn_model import EndOfTurnQueue

# The package's own deprecation noise when it loads its model (loaded in worker threads, where
# catch_warnings would race): importlib path and torch.jit.load.
warnings.filterwarnings("ignore", category=DeprecationWarning, module="silero_vad")
warnings.filterwarnings("ignore", message=".*torch.jit.load.*is deprecated", category=DeprecationWarning)

VAD_RATE = 16000
VAD_WINDOW = 512  # the only window size Silero accepts at 16 kHz
_CONTEXT = 64  # samples of the previous window the model sees before each window (at 16 kHz)
_STATE_SHAPE = (2, 1, 128)  # the LSTM's (h, c) of one stream
_LOAD_LOCK = threading.Lock()


def load_silero_16k() -> Any:
    """The package's 16 kHz network: forward(x [B, 64 + 512], state [2, B, 128]) -> (prob [B, 1], state).

    The package's wrapper keeps one state for one batch of a fixed size; we keep a state per session and
    call the network it wraps, so the wrapper's layout is checked here with a clear error.
    """
    from silero_vad import load_silero_vad

    # Test runners reset the module-level filters; catch_warnings is process-wide, so one load at a time
    # (several batchers may load at once in worker threads: two apps in one process).
    with _LOAD_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        wrapper = load_silero_vad()
    net = getattr(wrapper, "_model", None)
    if net is None or getattr(net, "context_size_samples", _CONTEXT) != _CONTEXT:
        import silero_vad

        raise RuntimeError(f"silero-vad {getattr(silero_vad, '__version__', '?')}: its JIT model no longer wraps "
                           f"a 16 kHz network with a {_CONTEXT}-sample context as `_model`; pin silero-vad to 5.x/6.x")
    return net


def one_thread_pools() -> None:
    """torch (the VAD) and numpy's BLAS (the end-of-turn model's features) on one thread each in a server process.
    Both start a thread per core in every process, and their idle threads spin-wait for a while after each call: every
    call a server process makes is small, so the extra threads buy nothing, and in 4 server processes on a 16-core
    host they kept most of its cores busy and slowed the end-of-turn model's calls from ~40 to 120-180 ms
    (docs/performance.md, Speech end -> first audio)."""
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    threadpool_limits(1, user_api="blas")


class VadStream:
    """One session's VAD: its model state, classified in batches with every other session's."""

    window = VAD_WINDOW

    def __init__(self, batcher: VadBatcher) -> None:
        self._batcher = batcher
        self.generation = 0  # bumped by reset: results of windows queued before it are not kept
        self.reset()

    def reset(self) -> None:
        self.generation += 1
        self.state = np.zeros(_STATE_SHAPE, np.float32)  # [2, 1, 128]
        self.context = np.zeros((1, _CONTEXT), np.float32)  # [1, 64]

    async def ready(self) -> None:
        """Loads the shared model (once per process; tens of ms) before the first audio needs it."""
        await self._batcher.ready()

    @property
    def end_of_turn(self) -> EndOfTurnQueue | None:
        """The end-of-turn model (semantic_vad), if this server runs one."""
        return self._batcher.end_of_turn

    @property
    def end_of_turn_in_server_vad(self) -> bool:
        """server_vad turns also end early when the end-of-turn model is confident."""
        return self._batcher.end_of_turn_in_server_vad

    @property
    def speculative_server_vad(self) -> bool:
        """server_vad answers start, held, after a short silence, before silence_duration_ms confirms the turn."""
        return self._batcher.speculative_server_vad

    async def probs(self, windows: np.ndarray) -> list[float]:
        """Speech probability of consecutive windows [n, 512] of this stream, in order."""
        if windows.ndim != 2 or windows.shape[1] != VAD_WINDOW:
            raise ValueError(f"VAD windows must be [n, {VAD_WINDOW}] at {VAD_RATE} Hz, got shape {windows.shape}")
        return await self._batcher.classify(self, windows)


@dataclass
class _Request:
    stream: VadStream
    windows: np.ndarray  # [n, 512]
    generation: int
    done: asyncio.Future[list[float]]
    state: np.ndarray | None = None  # [2, 1, 128] after the last window, set by the worker
    context: np.ndarray | None = None  # [1, 64]
    probs: list[float] = field(default_factory=list)


class VadBatcher:
    """Classifies all sessions' pending windows together: one batched call per round, rounds in one thread.

    A request waits for the next round (at most `round_every_s` after the last one began) and that round's
    call: a few ms, against the hundreds of ms of silence that end a turn. A stream's requests run in
    order, never two in one round, because its state carries from one to the next.
    """

    def __init__(self, load: Any = load_silero_16k, round_every_s: float = 0.008,
                 end_of_turn: EndOfTurnQueue | None = None, end_of_turn_in_server_vad: bool = False,
                 speculative_server_vad: bool = False) -> None:
        if round_every_s < 0:
            raise ValueError(f"round_every_s must be >= 0, got {round_every_s}")
        if end_of_turn_in_server_vad and end_of_turn is None:
            raise ValueError("end_of_turn_in_server_vad needs an end_of_turn model")
        self._load = load
        self.end_of_turn = end_of_turn
        self.end_of_turn_in_server_vad = end_of_turn_in_server_vad
        self.speculative_server_vad = speculative_server_vad
        # Rounds start at most this often: a window waits a few ms at most (a turn ends after hundreds
        # of ms of silence), and under load each round carries many sessions' windows, where one call's
        # fixed cost (~0.3 ms) would otherwise be paid every window or two.
        self._round_every_s = round_every_s
        self._net: Any = None
        self._load_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: list[_Request] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def stream(self) -> VadStream:
        return VadStream(self)

    @property
    def loaded(self) -> bool:
        return self._net is not None

    async def ready(self) -> None:
        if self._net is None:
            await asyncio.to_thread(self._model)

    async def classify(self, stream: VadStream, windows: np.ndarray) -> list[float]:
        loop, wake = self._bind_loop()
        req = _Request(stream, np.ascontiguousarray(windows, dtype=np.float32), stream.generation,
                       loop.create_future())
        self._queue.append(req)
        wake.set()
        return await req.done

    def _bind_loop(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Event]:
        # Futures and events belong to one loop; a batcher reused under a new loop (tests) starts afresh.
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._wake is None or self._task is None or self._task.done():
            if self._loop is loop:  # the runner died on this loop: its waiters hear of it, not wait forever
                for req in self._queue:
                    if not req.done.done():
                        req.done.set_exception(RuntimeError("the VAD batcher stopped; windows not classified"))
            self._loop, self._queue, self._wake = loop, [], asyncio.Event()
            self._task = loop.create_task(self._run(self._wake), name="vad-batcher")
        return loop, self._wake

    async def _run(self, wake: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        last_round = -math.inf
        while True:
            await wake.wait()
            if (wait := last_round + self._round_every_s - loop.time()) > 0:
                await asyncio.sleep(wait)
            last_round = loop.time()
            wake.clear()
            batch, later, seen = [], [], set()
            for req in self._queue:
                if req.done.done():  # the session went away (its task was cancelled)
                    continue
                (later if id(req.stream) in seen else batch).append(req)
                seen.add(id(req.stream))
            self._queue = later
            if later:
                wake.set()
            if not batch:
                continue
            try:
                await asyncio.to_thread(self._classify, batch)
            except Exception as e:  # noqa: BLE001 - every waiting session hears of it, the batcher goes on
                for req in batch:
                    if not req.done.done():
                        req.done.set_exception(e)
                continue
            for req in batch:
                if req.stream.generation == req.generation:  # not reset while its windows were classified
                    req.stream.state, req.stream.context = req.state, req.context
                if not req.done.done():
                    req.done.set_result(req.probs)

    def _model(self) -> Any:
        with self._load_lock:
            if self._net is None:
                self._net = self._load()
            return self._net

    def _classify(self, batch: list[_Request]) -> None:
        """Worker thread: round k runs window k of every request that has one, all in one call.

        numpy between calls, so a round costs a few array operations in Python however many sessions it
        carries (this thread shares the GIL with the event loop).
        """
        net = self._model()
        states = np.concatenate([req.stream.state for req in batch], axis=1)  # [2, B, 128]
        contexts = np.concatenate([req.stream.context for req in batch])  # [B, 64]
        counts = np.array([len(req.windows) for req in batch])  # [B]
        probs = np.zeros((len(batch), int(counts.max())), np.float32)  # [B, rounds]
        with torch.inference_mode():
            for k in range(probs.shape[1]):
                rows = np.flatnonzero(counts > k)  # [b]
                x = np.concatenate([contexts[rows], np.stack([batch[i].windows[k] for i in rows])], axis=1)
                out, state = net(torch.from_numpy(x), torch.from_numpy(states[:, rows]))  # [b, 1], [2, b, 128]
                probs[rows, k] = out[:, 0].numpy()
                states[:, rows] = state.numpy()
                contexts[rows] = x[:, -_CONTEXT:]
        for i, req in enumerate(batch):
            req.state, req.context = states[:, i:i + 1], contexts[i:i + 1]
            req.probs = probs[i, :counts[i]].tolist()
