"""The engines a server places sessions on: one (the default), one per GPU (`--gpus`), or Ray Serve's replicas.

A new session goes to the ready engine with the most headroom (`headroom`) and stays there for its life: its
history lives in that engine's KV cache. An engine that is still loading, or lost and restarting, takes none. An
engine that is lost ends only the sessions placed on it (EngineClient does that); the others carry on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from server.engine_client import EngineClient

log = logging.getLogger("server.engines")

# A step this long counts as one more session's worth of load: at ~10 ms an H200 step under 128 sessions, an engine
# twice as slow per step is as loaded as one with twice the requests.
STEP_REF_MS = 10.0
_SUMMED = ("running", "waiting", "kv_free", "kv_total", "sessions", "steps", "prefilled_rows", "decoded_rows",
           "decoder_pages_free", "decoder_pages_total", "decoder_pages_forgotten")


def headroom(stats: dict[str, Any], placed: int) -> float:
    """How much more an engine can take, from its last Pong's stats and the sessions this server placed on it
    (counted here at once: a Pong is a ping interval old, and a burst of sessions must not all go to one engine).
    The free share of its KV pool (or of its speech decoder's cache, when that is less), divided by its load (placed
    sessions plus running and waiting requests, so an answering session counts twice), scaled down by its recent
    step time."""
    free = min(_share(stats, "kv_free", "kv_total"), _share(stats, "decoder_pages_free", "decoder_pages_total"))
    load = placed + _num(stats.get("running")) + _num(stats.get("waiting"))
    return free / ((1.0 + load) * (1.0 + _num(stats.get("step_ms")) / STEP_REF_MS))


def _share(stats: dict[str, Any], free_key: str, total_key: str) -> float:
    """free / total of a pool the stats report, 1.0 when they do not."""
    free, total = stats.get(free_key), stats.get(total_key)
    return free / total if isinstance(free, int | float) and isinstance(total, int | float) and total > 0 else 1.0


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) else 0.0


class EnginePool:
    """Engines by name ("0", "1"... for --gpus; a replica's id under Ray), each with its own EngineClient."""

    def __init__(self, engines: Iterable[EngineClient] = ()) -> None:
        self.engines: dict[str, EngineClient] = {e.name: e for e in engines}
        self.removed_restarts = 0  # restarts counted by engines no longer in the pool (Ray replicas gone)
        self.on_change: Callable[[], None] | None = None  # called once an engine joined or left

    @property
    def ready(self) -> bool:
        return any(e.ready for e in self.engines.values())

    @property
    def restarts(self) -> int:
        return self.removed_restarts + sum(e.restarts for e in self.engines.values())

    def pick(self) -> EngineClient | None:
        """The ready engine with the most headroom (ties: the first by name), or None when none is ready."""
        best, best_room = None, -1.0
        for e in self.engines.values():
            if not e.ready:
                continue
            room = headroom(e.stats, e.placed)
            if room > best_room:
                best, best_room = e, room
        return best

    def session_limit(self, size: Callable[[list[dict[str, Any]]], int]) -> int:
        """The sessions the engines hold together: `size` of their stats (server.limits.size_from_engines)."""
        return size([e.stats for e in self.engines.values()])

    def stats(self) -> dict[str, Any]:
        """The aggregate of the engines' last stats: counts summed; the rest from the first engine that has them."""
        out: dict[str, Any] = {}
        for e in self.engines.values():
            for k, v in e.stats.items():
                if k in _SUMMED and isinstance(v, int | float):
                    out[k] = out.get(k, 0) + v
                else:
                    out.setdefault(k, v)
        return out

    def each(self) -> dict[str, dict[str, Any]]:
        """Each engine's state for /health."""
        return {name: {"alive": e.ready, "sessions_placed": e.placed, "restarts": e.restarts,
                       "endpoint": e.endpoint, "stats": e.stats} for name, e in self.engines.items()}

    async def start(self) -> None:
        """Start every engine and wait until all answer; one that fails to load fails the start (and stops the rest)."""
        try:
            await asyncio.gather(*(e.start() for e in self.engines.values()))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.engines.values()), return_exceptions=True)

    async def add(self, engine: EngineClient) -> None:
        """Connect to one more engine (a Ray replica that registered) and let it take sessions once it answers."""
        self.engines[engine.name] = engine
        await engine.start()
        log.info("engine %s joined at %s", engine.name, engine.endpoint)
        if self.on_change is not None:
            self.on_change()

    async def remove(self, name: str, why: str) -> None:
        """Drop an engine that is gone (a Ray replica that stopped): its sessions end with engine_unavailable."""
        e = self.engines.pop(name, None)
        if e is None:
            return
        log.warning("engine %s left (%s): ending its %d session(s)", name, why, e.placed)
        e.end_sessions()
        self.removed_restarts += e.restarts + 1
        await e.stop()
        if self.on_change is not None:
            self.on_change()


def stats_callback(metrics: Any, pool: Callable[[], EnginePool], name: str) -> Callable[[dict[str, Any]], None]:
    """An engine's on_stats: its own gauges (label engine) and the aggregate ones from every engine's last stats."""

    def on_stats(stats: dict[str, Any]) -> None:
        metrics.engine_stats(stats, engine=name)
        metrics.engine_stats(pool().stats())

    return on_stats
