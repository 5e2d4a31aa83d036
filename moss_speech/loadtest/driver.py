"""Start the users (ramped), stop everything at the deadline, optionally across worker processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import sys
import time
from collections.abc import Callable

from moss_speech.loadtest.audio import Utterance, silence_frame_b64
from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.results import Collector
from moss_speech.loadtest.stats import percentile

GRACE_S = 5.0  # after the deadline: time for cancelled users to close their connections


def _user_class(cfg: LoadConfig):
    if cfg.transport == "webrtc":
        from moss_speech.loadtest.client_webrtc import WebRtcUser

        return WebRtcUser
    from moss_speech.loadtest.client_ws import WsUser

    return WsUser


async def run_users(cfg: LoadConfig, indices: list[int], utt: Utterance, collector: Collector,
                    start_wall: float) -> None:
    """Run the users `indices` of the plan; user i starts at start_wall + i / ramp. Returns by the deadline."""
    cls = _user_class(cfg)
    speech, silence = cls.prepare_frames(utt.frames_b64(cfg.frame_ms), silence_frame_b64(cfg.frame_ms))
    loop = asyncio.get_running_loop()
    # Wall clock only to agree with other worker processes on t0; the loop's monotonic clock from here on.
    t0 = loop.time() + (start_wall - time.time())
    deadline = t0 + cfg.duration_s

    async def one(i: int) -> None:
        delay = t0 + (i / cfg.ramp_per_s if cfg.ramp_per_s else 0.0) - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if loop.time() >= deadline:
            return
        user = cls(cfg, i, speech, silence, utt.duration_s, collector, t0, deadline)
        await user.run()

    tasks = [asyncio.create_task(one(i)) for i in indices]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=GRACE_S)


def progress_line(c: Collector, cfg: LoadConfig, elapsed: float) -> str:
    ttfa = [r.ttfa_ms for r in c.records if r.ttfa_ms is not None]
    p50 = percentile(ttfa, 50)
    p95 = percentile(ttfa, 95)
    fmt = lambda v: "-" if v is None else f"{v:.0f}"
    active = c.sessions_started - c.sessions_ended
    return (f"[{elapsed:6.1f}s] sessions {active} active / {c.sessions_started} started of {cfg.sessions}  "
            f"turns {len(c.records)}/{cfg.sessions * cfg.turns}  ttfa p50 {fmt(p50)} p95 {fmt(p95)} ms  "
            f"underruns {sum(r.underruns for r in c.records)}  errors {sum(c.errors.values())}")


class _Progress:
    def __init__(self, cfg: LoadConfig, enabled: bool) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0

    def show(self, c: Collector, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        # A terminal gets a line rewritten every second; a log file one line every 5 s.
        if not final and now - self.last < (1.0 if self.tty else 5.0):
            return
        self.last = now
        line = progress_line(c, self.cfg, now - self.t0)
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _worker(w: int, cfg: LoadConfig, indices: list[int], utt: Utterance, start_wall: float, out: mp.Queue) -> None:
    c = Collector()

    async def main() -> None:
        async def report() -> None:
            while True:
                await asyncio.sleep(1.0)
                out.put(("progress", w, c.to_dict()))

        rep = asyncio.create_task(report())
        try:
            await run_users(cfg, indices, utt, c, start_wall)
        finally:
            rep.cancel()

    try:
        asyncio.run(main())
        out.put(("done", w, c.to_dict()))
    except BaseException as e:  # noqa: BLE001 - the parent must hear about any death
        out.put(("died", w, f"{type(e).__name__}: {e}"))
        raise


def run_load(cfg: LoadConfig, utt: Utterance, progress: bool = True,
             on_tick: Callable[[Collector], None] | None = None) -> tuple[Collector, float]:
    """Runs the whole plan; returns the merged collector and the wall time taken."""
    prog = _Progress(cfg, progress)
    start_wall = time.time() + 0.2
    t_start = time.monotonic()
    if cfg.workers == 1:
        c = Collector()

        async def main() -> None:
            async def tick() -> None:
                while True:
                    await asyncio.sleep(0.5)
                    prog.show(c)
                    if on_tick:
                        on_tick(c)

            tk = asyncio.create_task(tick())
            try:
                await run_users(cfg, list(range(cfg.sessions)), utt, c, start_wall)
            finally:
                tk.cancel()

        asyncio.run(main())
        prog.show(c, final=True)
        return c, time.monotonic() - t_start
    return _run_workers(cfg, utt, start_wall, prog, t_start)


def _run_workers(cfg: LoadConfig, utt: Utterance, start_wall: float, prog: _Progress,
                 t_start: float) -> tuple[Collector, float]:
    ctx = mp.get_context("fork")  # the workers inherit the loaded utterance; no event loop exists yet here
    out: mp.Queue = ctx.Queue()
    n = min(cfg.workers, cfg.sessions)
    procs = [ctx.Process(target=_worker, args=(w, cfg, list(range(w, cfg.sessions, n)), utt, start_wall, out),
                         daemon=True) for w in range(n)]
    for p in procs:
        p.start()
    latest: dict[int, Collector] = {}  # newest snapshot per worker, for the progress line
    finals: dict[int, Collector] = {}
    merged = Collector()
    hard_stop = time.monotonic() + cfg.duration_s + 2 * GRACE_S + 10
    while len(finals) < n and time.monotonic() < hard_stop:
        try:
            kind, w, payload = out.get(timeout=0.5)
        except queue.Empty:
            kind = None
        if kind == "progress":
            latest[w] = Collector.from_dict(payload)
        elif kind == "done":
            finals[w] = latest[w] = Collector.from_dict(payload)
        elif kind == "died":
            merged.error("loadtest_worker_died", str(payload))
            finals[w] = Collector()
        view = Collector()
        for col in latest.values():
            view.merge(col)
        prog.show(view)
    for w, p in enumerate(procs):
        p.join(timeout=GRACE_S)
        if p.is_alive():
            p.kill()
        if w not in finals:
            merged.error("loadtest_worker_lost", f"worker {w} (pid {p.pid}) sent no result")
    for col in finals.values():
        merged.merge(col)
    prog.show(merged, final=True)
    return merged, time.monotonic() - t_start
