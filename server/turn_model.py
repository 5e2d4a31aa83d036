"""The end-of-turn model: whether the speaker has finished, judged from the sound of the turn (Smart Turn v3.2).

Silence alone cannot tell a finished sentence from a breath between clauses; Smart Turn listens to the words and
their prosody. It is a Whisper-tiny encoder with a classifier head, int8 for CPUs (~8 MB), BSD-2 licensed by Daily and
shipped here as package data (server/data/smart-turn-v3.2-cpu.onnx, its licence beside it in
LICENSE-smart-turn.txt). Input: the last 8 s of the turn at 16 kHz, zero-padded at the front, as Whisper log-mel
features [80, 800] (25 ms windows every 10 ms, 80 Slaney mel bands, waveform normalised to zero mean and unit
variance first, log10 clipped 8 below its maximum, then (x + 4) / 4). Output: P(the turn is complete), a sigmoid.

One model serves every session of the process; `EndOfTurnQueue` answers the turns one at a time, in the order asked,
on a worker thread (onnxruntime releases the GIL), never on the event loop. Batching buys nothing here: on the
16-core Xeon host of an H200 a turn costs 54 ms on one thread, 34-43 on two, 31-34 on four, alone or in batches of 8
alike within a few ms; on the 2-core development box 36 ms alone against 42-46 in batches of 8 (2026-12-03; the
features ~2 ms of it). A batch answers all its turns when its last is done; one at a time answers each as soon as it
is, and skips a question withdrawn while it waited (docs/bench/end_of_turn_queue.py measures the wait).
`threads_for` gives each server process its share of the cores.

`python3 -m server.turn_model WAV...`: what the model says of a recording's pauses (each silence of 200 ms or more,
judged 200 ms into it, or `--after-ms` in) and of its end.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from server.audio.pcm import read_wav

log = logging.getLogger("server.turn_model")

MODEL_PATH = Path(__file__).resolve().parent / "data" / "smart-turn-v3.2-cpu.onnx"
RATE = 16000
WINDOW_SAMPLES = 8 * RATE  # the model hears the last 8 s
_N_FFT, _HOP, _N_MELS = 400, 160, 80


def _mel_filters() -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters [201, 80] over 0-8 kHz (Whisper's)."""

    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, np.float64)
        return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) * 27.0 / np.log(6.4), 3.0 * f / 200.0)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), 200.0 * m / 3.0)

    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(RATE / 2), _N_MELS + 2))  # [82]
    bins = np.linspace(0, RATE // 2, _N_FFT // 2 + 1)  # [201]
    slopes = edges[None, :] - bins[:, None]  # [201, 82]
    width = np.diff(edges)  # [81]
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    return np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]


_MEL = _mel_filters()  # [201, 80]
_HANN = np.hanning(_N_FFT + 1)[:-1]  # periodic


def log_mel(audio: np.ndarray) -> np.ndarray:
    """The model's input features [80, 800] (float32) of the last 8 s of `audio` (16 kHz mono float)."""
    x = np.asarray(audio, np.float32).reshape(-1)[-WINDOW_SAMPLES:]
    x = np.pad(x, (WINDOW_SAMPLES - len(x), 0))  # [128000], silence before a short turn
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), (_N_FFT // 2, _N_FFT // 2), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, _N_FFT)[::_HOP]  # [801, 400]
    power = np.abs(np.fft.rfft(frames * _HANN, axis=-1)) ** 2  # [801, 201]
    spec = np.log10(np.maximum(power @ _MEL, 1e-10)).T[:, :-1]  # [80, 800]
    spec = np.maximum(spec, spec.max() - 8.0)
    return ((spec + 4.0) / 4.0).astype(np.float32)


def threads_for(processes: int, cores: int | None = None) -> int:
    """Threads for one server process's model, when `processes` server processes share the machine: half of
    their share of its cores (the engine process, the event loops and the VAD want the rest), 1 to 4."""
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)  # (Linux: the cores this process may use)
        cores = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return max(1, min(4, cores // (2 * processes)))


class SmartTurn:
    """The ONNX model on the CPU: `complete([audio, ...])` -> P(complete) of each turn."""

    def __init__(self, path: Path = MODEL_PATH, threads: int = 1) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        # Idle threads sleep instead of spinning: the cores are the event loops' and the engine's between calls.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        (inp,) = self._session.get_inputs()
        if inp.name != "input_features" or list(inp.shape[1:]) != [_N_MELS, 800]:
            raise RuntimeError(f"{path}: expected input_features [B, 80, 800], got {inp.name} {inp.shape}")

    def complete(self, turns: list[np.ndarray]) -> list[float]:
        feats = np.stack([log_mel(a) for a in turns])  # [B, 80, 800]
        out = self._session.run(None, {"input_features": feats})[0]  # [B, 1], already a sigmoid
        return [float(p) for p in np.asarray(out).reshape(-1)]


@dataclass
class _Ask:
    audio: np.ndarray
    done: asyncio.Future[float]
    asked: float  # the loop's clock


class EndOfTurnQueue:
    """P(complete) for any session's turn, off the event loop: one turn a call, in the order asked; a question
    withdrawn (its waiter cancelled) before its call starts is skipped. `load`: builds the model (default: the shipped
    Smart Turn) on first use, in the worker thread. `observe(outcome, wait_s, call_s)`: each question's end, `answered`
    (asked -> answered in `wait_s`), `stale` (run, but withdrawn meanwhile), `withdrawn` (skipped; both None) or
    `failed`; `call_s` the model's own time in its thread (features included), apart from the wait in the queue."""

    def __init__(self, load: Any = SmartTurn,
                 observe: Callable[[str, float | None, float | None], None] | None = None) -> None:
        self._load = load
        self._observer = observe
        self._model: Any = None
        self._load_lock = threading.Lock()
        self._queue: deque[_Ask] = deque()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def ready(self) -> None:
        if self._model is None:
            await asyncio.to_thread(self._ensure)

    async def complete(self, audio: np.ndarray) -> float:
        """P(the speaker has finished) given the turn's audio so far (16 kHz float32; the last 8 s count)."""
        loop = asyncio.get_running_loop()
        ask = _Ask(np.asarray(audio, np.float32)[-WINDOW_SAMPLES:], loop.create_future(), loop.time())
        if self._loop is not loop or self._task is None or self._task.done():
            self._loop, self._queue = loop, deque()
            self._task = loop.create_task(self._run(), name="end-of-turn")
        self._queue.append(ask)
        return await ask.done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            ask = self._queue.popleft()
            if ask.done.done():  # withdrawn while it waited
                self._observe("withdrawn", None, None)
                continue
            try:
                p, call_s = await asyncio.to_thread(self._call, ask.audio)
            except Exception as e:  # noqa: BLE001 - the turn still ends after its longest silence
                if not ask.done.done():
                    ask.done.set_exception(e)
                self._observe("failed", loop.time() - ask.asked, None)
                continue
            if ask.done.done():
                self._observe("stale", loop.time() - ask.asked, call_s)
            else:
                ask.done.set_result(p)
                self._observe("answered", loop.time() - ask.asked, call_s)

    def _observe(self, outcome: str, wait_s: float | None, call_s: float | None) -> None:
        if self._observer is None:
            return
        try:
            self._observer(outcome, wait_s, call_s)
        except Exception:  # noqa: BLE001 - a metrics fault must not stop the questions of every session behind it
            log.exception("end-of-turn observer failed")

    def _ensure(self) -> Any:
        with self._load_lock:
            if self._model is None:
                self._model = self._load()
            return self._model

    def _call(self, audio: np.ndarray) -> tuple[float, float]:
        """(P(complete), the call's seconds) of one turn, in the worker thread."""
        model = self._ensure()
        t = time.perf_counter()
        (p,) = model.complete([audio])
        return p, time.perf_counter() - t


def pause_scores(model: SmartTurn, audio: np.ndarray, after_ms: int = 200, min_pause_ms: int = 200,
                 quiet: float = 0.05) -> list[tuple[float, int, float]]:
    """(second, pause ms, P(complete)) at each pause of 16 kHz `audio` (20 ms frames whose RMS is under `quiet` of the
    loudest frame's, `min_pause_ms` or longer, after speech and before more), judged on the audio up to `after_ms`
    into it; and at the end (pause 0)."""
    frame = RATE // 50
    rms = np.sqrt(np.mean(audio[: audio.size // frame * frame].reshape(-1, frame) ** 2, axis=1))  # [frames]
    silent = np.append(rms < quiet * rms.max(), False)
    points, start = [], None
    for i, s in enumerate(silent):
        if s and start is None:
            start = i
        elif not s and start is not None:
            if start > 0 and (i - start) * 20 >= min_pause_ms and i < silent.size - 1:  # (not before the speech)
                points.append((start * 20, (i - start) * 20))
            start = None
    cuts = [(ms, n, min(audio.size, (ms + after_ms) * RATE // 1000)) for ms, n in points]
    cuts.append((audio.size * 1000 // RATE, 0, audio.size))
    probs = model.complete([audio[:c] for *_, c in cuts])
    return [(ms / 1000, n, p) for (ms, n, _), p in zip(cuts, probs, strict=True)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m server.turn_model", description=__doc__.split("\n\n")[-1])
    ap.add_argument("wav", nargs="+")
    ap.add_argument("--after-ms", type=int, default=200, help="how far into each pause it is judged (default 200)")
    args = ap.parse_args(argv)
    if args.after_ms < 0:
        ap.error(f"--after-ms must be >= 0, got {args.after_ms}")
    model = SmartTurn()
    for path in args.wav:
        pcm, _ = read_wav(path, RATE)
        for t, pause, p in pause_scores(model, pcm, after_ms=args.after_ms):
            where = f"pause of {pause} ms" if pause else "end"
            print(f"{path} {t:6.2f} s {where}: P(complete) {p:.2f}")


if __name__ == "__main__":
    main()
