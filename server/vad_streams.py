"""Each session's VAD stream, from one batcher per app (server/vad.py), built without importing torch until the
first stream or the preload asks for it."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from server.ops.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("server.vad_streams")


class VadStreams:
    """Each session's VAD stream, all from one batcher per app (preloaded while the engine starts)."""

    def __init__(self, settings: Settings, metrics: Metrics, own_process: bool = False) -> None:
        self._batcher: Any = None
        self._lock = threading.Lock()  # sessions open in worker threads
        self._settings = settings
        self._metrics = metrics
        self._own_process = own_process

    def batcher(self) -> Any:
        with self._lock:
            if self._batcher is None:
                from server.turn_model import SmartTurn, threads_for
                from server.vad import EndOfTurnQueue, VadBatcher, one_thread_pools  # (torch: seconds, GIL held)

                if self._own_process:  # (never in a process that also runs other work, e.g. a test's engine)
                    one_thread_pools()
                st = self._settings
                threads = threads_for(st.workers)
                end_of_turn = (EndOfTurnQueue(load=lambda: SmartTurn(threads=threads),
                                              observe=self._metrics.end_of_turn_question)
                               if st.end_of_turn_model else None)
                self._batcher = VadBatcher(end_of_turn=end_of_turn,
                                           end_of_turn_in_server_vad=st.server_vad_end_of_turn,
                                           speculative_server_vad=st.speculative_server_vad)
        return self._batcher

    def __call__(self) -> Any:
        return self.batcher().stream()

    async def preload(self) -> None:
        """Import torch and load the model before serving. At the first server_vad session instead, the
        import held the GIL for ~3 s and stalled every session connected at the time. A failure here only
        logs: server_vad sessions try again (and report it), the rest of the server serves."""
        try:
            batcher = await asyncio.to_thread(self.batcher)
            await batcher.ready()
            if batcher.end_of_turn is not None:
                await batcher.end_of_turn.ready()
        except Exception:  # noqa: BLE001 - e.g. a broken silero-vad install
            log.exception("the VAD model did not load; server_vad sessions will retry")

    @property
    def loaded(self) -> bool:
        return self._batcher is not None and self._batcher.loaded
