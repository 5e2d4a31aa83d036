"""What a Session sends to the engine: the link it needs, and its conversation inputs in order.

Conversation inputs (user audio, items, commits, CreateResponse) go strictly in order. Those that arrive while the
engine generates an answer (from CreateResponse sent until its ResponseDone) are held and sent after it ends, so the
engine always sees: answer, (truncate), next user turn. Control messages (open, cancel, barge-in truncation, close)
go straight to the link. The engine's outputs come back through `Session.on_engine_message` (responses.py).

The engine may answer any conversation input (an item refused as too large is an `error` event for the client),
after the session has moved on. So that these replies never come faster than the client reads them, a session has at
most SYNC_EVERY inputs in flight: then it sends a Sync and sends nothing more until the engine's Synced says it has
handled (and answered) everything before it. The client's next event waits meanwhile, as it waits for room in the
outbound stream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engines.protocol import messages as m
from server.audio.pcm import float32_to_pcm16
from server.session.tasks import Background

if TYPE_CHECKING:
    from server.session.session import Session

# User audio goes to the engine in messages of at least this much (96 ms: three VAD windows, more than one speech
# code), and whatever is left before any other engine input. The engine encodes held audio every 80-320 ms anyway,
# so this costs no latency; one message per 32 ms VAD window would be ~1,700 messages a second at 108 sessions for
# the engine loop to take between its steps (a third as many this way).
APPEND_MIN_SAMPLES = 1536
# Conversation inputs in flight before a session waits for the engine to catch up (see the module doc). Their replies
# fit in the outbound stream's free half beside what the client's own events caused.
SYNC_EVERY = 64


class EngineLink(Protocol):
    """What a Session needs from the engine client (server.engine_client.EngineClient)."""

    ready: bool

    async def send(self, msg: Any) -> None: ...

    def register(self, session_id: str, session: Session) -> None: ...

    def unregister(self, session_id: str) -> None: ...


class EngineInputs:
    """One session's conversation inputs for the engine, in order (see the module doc)."""

    def __init__(self, session_id: str, engine: EngineLink, tasks: Background, closed: Callable[[], bool]) -> None:
        self.id = session_id
        self.engine = engine
        self._tasks = tasks
        self._closed = closed
        # Held while the engine generates an answer (from CreateResponse sent until its ResponseDone).
        self._held: deque[Any] = deque()
        self._engine_busy = False
        self._flushing = False
        self._unsent_16k: list[np.ndarray] = []  # user audio not yet sent (< APPEND_MIN_SAMPLES)
        self._in_flight = 0  # inputs sent since the engine's last Synced
        self._sync_seq = 0
        self._sync_wait: asyncio.Future[None] | None = None

    @property
    def idle(self) -> bool:
        """Nothing held and no answer in the engine: the next input goes straight to it."""
        return not (self._engine_busy or self._held or self._flushing)

    async def send(self, msg: Any) -> None:
        """Conversation input (user audio, items, CreateResponse) for the engine, strictly in order; held
        from a CreateResponse until its answer has ended (see module doc). User audio not yet sent goes first."""
        await self.flush_user_audio()
        await self._send_or_hold(msg)

    async def user_audio(self, pcm16k: np.ndarray) -> None:
        """User speech at 16 kHz; sent once APPEND_MIN_SAMPLES have gathered, or before the next other input."""
        self._unsent_16k.append(pcm16k)
        if sum(len(x) for x in self._unsent_16k) >= APPEND_MIN_SAMPLES:
            await self.flush_user_audio()

    def drop_user_audio(self) -> int:
        """Forget the user audio not yet sent (the input buffer was cleared); returns its samples."""
        unsent = sum(len(x) for x in self._unsent_16k)
        self._unsent_16k = []
        return unsent

    async def flush_user_audio(self) -> None:
        if self._unsent_16k:
            pcm = np.concatenate(self._unsent_16k) if len(self._unsent_16k) > 1 else self._unsent_16k[0]
            self._unsent_16k = []
            await self._send_or_hold(m.AppendUserAudio(session_id=self.id, pcm16k=float32_to_pcm16(pcm)))

    def unsend_create(self, response_id: str, instead: Any = None) -> bool:
        """Take back a CreateResponse still held (`instead` goes in its place); False if the engine has it."""
        for i, msg in enumerate(self._held):
            if isinstance(msg, m.CreateResponse) and msg.response_id == response_id:
                del self._held[i]
                if instead is not None:
                    self._held.insert(i, instead)
                return True
        return False

    def answer_ended(self, first: Any = None) -> None:
        """The engine's answer ended (its ResponseDone, or a failure): `first`, then what was held, go now."""
        self._engine_busy = False
        if first is not None:
            self._held.appendleft(first)
        if self._held:
            self._tasks.spawn(self._flush_held(), "flush-held")

    async def _send_or_hold(self, msg: Any) -> None:
        if self._engine_busy or self._held or self._flushing:
            self._held.append(msg)
        else:
            await self._send_ordered(msg)

    async def _send_ordered(self, msg: Any) -> None:
        if isinstance(msg, m.CreateResponse):
            self._engine_busy = True
        await self.engine.send(msg)
        self._in_flight += 1
        if self._in_flight >= SYNC_EVERY:
            await self._sync()

    async def _sync(self) -> None:
        """Until the engine has handled the inputs sent before the Sync out (or the session ended). Inputs come
        from more than one task (the turn detector's audio, an automatic answer): one that reaches SYNC_EVERY while
        a Sync is out waits for that one, never sends its own in its place (whose Synced alone would be heard,
        leaving the first waiter waiting for good)."""
        wait = self._sync_wait
        if wait is None or wait.done():
            self._sync_seq += 1
            wait = self._sync_wait = asyncio.get_running_loop().create_future()
            await self.engine.send(m.Sync(session_id=self.id, seq=self._sync_seq))
        await asyncio.shield(wait)  # (one waiter cancelled leaves it to the others)
        self._in_flight = 0

    def synced(self, seq: int) -> None:
        """The engine's Synced: it has handled the inputs sent before Sync `seq`."""
        if seq == self._sync_seq and self._sync_wait is not None and not self._sync_wait.done():
            self._sync_wait.set_result(None)

    def stop(self) -> None:
        """The session ended: nothing waits for the engine any more."""
        if self._sync_wait is not None and not self._sync_wait.done():
            self._sync_wait.set_result(None)

    async def _flush_held(self) -> None:
        if self._flushing:
            return
        self._flushing = True
        try:
            while self._held and not self._engine_busy and not self._closed():
                await self._send_ordered(self._held.popleft())
        finally:
            self._flushing = False
