"""Throw-away spoken turns before the engine process serves anyone (`--warm-up`, the default on a GPU)."""

from __future__ import annotations

import time

import numpy as np

from engines.audio.wav import float32_to_pcm16
from engines.process.outputs import Out
from engines.process.service import Service
from engines.protocol import messages as m

_WARM_UP = b"warm-up"  # the client id of the start-up turns


def warm_up(service: Service, batches: tuple[int, ...] = (1, 4), rows: int = 24, timeout_s: float = 300.0) -> None:
    """Throw-away spoken turns (noise in, `rows` answer rows out) for 1, then several sessions at once, so
    that first-use costs are paid before anyone connects: library start-up (cuFFT, cuDNN), per-shape plans
    and Triton compiles that a first caller would otherwise wait 150-500 ms for, stalling every session.
    In a batch of several, the last session answers in text: the text channel's sampling kernels are compiled
    apart from the audio channel's, and a spoken answer samples text once it ends its speech (an H200 load
    test stalled 6.2 s at 108 sessions compiling them). Leaves no session, KV block or codec work behind; raises
    if any turn fails."""
    pcm = float32_to_pcm16((0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32))
    sampling = m.Sampling(max_new_tokens=rows, min_new_tokens=rows)
    for n in batches:
        ids = [f"warm-up-{n}-{i}" for i in range(n)]
        out = [o for sid in ids for o in service.handle(_WARM_UP, m.OpenSession(sid, sampling=sampling))]
        for i in range(0, len(pcm), 640):  # 20 ms pieces of every session together, as under load
            out += service.handle_many([(_WARM_UP, m.AppendUserAudio(sid, pcm[i:i + 640])) for sid in ids])
        for sid in ids:
            out += service.handle(_WARM_UP, m.CommitUserAudio(sid, "warm-up"))
            modality = "text" if n > 1 and sid == ids[-1] else "audio"
            out += service.handle(_WARM_UP, m.CreateResponse(sid, f"{sid}-answer", modality, sampling))
        done: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < n and service.has_work() and time.monotonic() < deadline:
            step = _step(service)
            out += step
            done |= {msg.session_id for _, msg in step if isinstance(msg, m.ResponseDone)}
        for sid in ids:
            out += service.handle(_WARM_UP, m.CloseSession(sid))
        while service.has_work() and time.monotonic() < deadline:  # closed sessions' last audio, KV release
            out += _step(service)
        failed = [msg for _, msg in out if isinstance(msg, m.Error)]
        if failed or len(done) < n:
            raise RuntimeError(f"warm-up with {n} sessions failed: {failed[:3] or 'answers did not finish'}")


def _step(service: Service) -> list[Out]:
    if not service.engine.has_work():
        time.sleep(0.002)  # only the codec worker is busy: let it have the GIL
    return service.step()
