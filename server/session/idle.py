"""`turn_detection.idle_timeout_ms` (server_vad): when the user has said nothing for that long after the last answer's
audio finished playing, the server commits the silent input (`input_audio_buffer.timeout_triggered`, then
`input_audio_buffer.committed`) and answers, so the model can prompt the user to go on.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from server.session import server_events as ev

if TYPE_CHECKING:
    from server.session.session import Session


class IdleTimeout:
    def __init__(self, session: Session) -> None:
        self.s = session
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, playing_for_s: float) -> None:
        """An answer ended; its audio plays for `playing_for_s` more seconds (0 if it has been heard)."""
        self.disarm()
        td = self.s.config.turn_detection
        if td is None or td.idle_timeout_ms is None or self.s.closed:
            return
        delay = max(0.0, playing_for_s) + td.idle_timeout_ms / 1000.0
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self.s.tasks.spawn(self._trigger(), "idle-timeout")

    async def _trigger(self) -> None:
        s = self.s
        td = s.config.turn_detection
        if s.closed or td is None or td.idle_timeout_ms is None or s.turns.in_speech or s.responses.active:
            return
        end_ms = s.turns.position_ms
        item_id = ev.new_id("item")
        s.emit(ev.event("input_audio_buffer.timeout_triggered", audio_start_ms=max(0, end_ms - td.idle_timeout_ms),
                        audio_end_ms=end_ms, item_id=item_id))
        s.turns.item_id = item_id
        await s.turns.flush_prefix()  # the silence the VAD kept: the committed (silent) turn
        await s.input_buffer.commit(auto_response=True)
