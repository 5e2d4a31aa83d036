"""Waiting on what a client has received, without sleeping: a reader appends and wakes the waiters."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any


async def at_real_time(chunks: Sequence[Any], send: Callable[[Any], Awaitable[None]], chunk_s: float) -> None:
    """Send `chunks` of `chunk_s` seconds of audio each as a microphone does: one per `chunk_s` of wall time. (Sent
    faster, a whole utterance's turn ends before a client can react to its start, which no user can do.)"""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i, c in enumerate(chunks):
        await send(c)
        await asyncio.sleep(max(0.0, t0 + (i + 1) * chunk_s - loop.time()))


class Seen:
    def __init__(self) -> None:
        self.items: list[Any] = []
        self._changed = asyncio.Event()

    def add(self, item: Any) -> None:
        self.items.append(item)
        self._changed.set()

    async def until(self, pred: Callable[[list[Any]], bool], what: str, timeout: float = 240.0,
                    failed: Callable[[Any], bool] = lambda _: False) -> None:
        """Until `pred(items)` holds; AssertionError as soon as an item is `failed` (the timeout only bounds a
        hang)."""
        async def wait() -> None:
            while not pred(self.items):
                bad = [x for x in self.items if failed(x)]
                assert not bad, f"while waiting for {what}: {bad}"
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            got = [getattr(x, "type", None) or getattr(x, "name", None) or x for x in self.items[-30:]]
            raise AssertionError(f"timed out waiting for {what}; the last of what came: {got}") from None
