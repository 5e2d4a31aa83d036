"""Tasks an object starts and does not await (a session's held-input flush, a call's media pumps).

The event loop keeps only weak references to tasks, so each is held here until it ends; and a task that fails is
logged with its traceback and reported to the owner's `on_error` (which ends the session or call) instead of
vanishing as "Task exception was never retrieved" while its owner waits for it forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any


class Background:
    def __init__(self, owner: str, log: logging.Logger | logging.LoggerAdapter, on_error: Callable[[str], None]
                 ) -> None:
        self.owner = owner  # names the tasks and the log lines, e.g. "call-rtc_..." or "sess_..."
        self.log = log
        self.on_error = on_error  # called with the failed task's name
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}-{name}")
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def cancel(self) -> None:
        """Cancel every task but the one running this call (a close started from inside one of them)."""
        current = asyncio.current_task()
        for t in list(self.tasks):
            if t is not current:
                t.cancel()

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        self.log.error("%s: task %s failed", self.owner, task.get_name(), exc_info=task.exception())
        self.on_error(task.get_name())
