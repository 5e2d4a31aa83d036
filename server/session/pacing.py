"""A session's bounded outbound stream (server events and answer audio, in order, for one transport), and how an
answer's audio plays out for its listener.

The session puts items without waiting (it runs inside the engine's receive loop and must never
block it); the transport awaits `get()`. When a client does not read, the queue fills; instead of
growing memory the stream drops what is queued, keeps one final `error` event (code
`slow_consumer`) and ends, and the transport closes the connection after sending it. A transport waits on `room()`
before it reads the client's next event, so that a client's own events (each answered by one or more) fill the queue
only as fast as the client reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moss_speech.loadtest.stats import PlaybackBuffer

if TYPE_CHECKING:
    from server.session.session import SessionObserver

ANSWER_RATE = 24000
LISTENER_PREBUFFER_S = 0.06  # the modelled listener's jitter buffer (the load test's and the WebRTC track's default)


@dataclass(frozen=True)
class AudioOut:
    """Answer audio for a transport that plays PCM itself (WebRTC): int16 LE mono, 24 kHz."""

    response_id: str
    item_id: str
    pcm24k: bytes
    index: int  # chunk number within the response (-1: what the speed filter held back, at its end)

    @property
    def samples(self) -> int:
        return len(self.pcm24k) // 2


# An outbound item is a server event (a JSON-ready dict) or AudioOut (track transports only).
OutItem = dict[str, Any] | AudioOut


@dataclass
class _Entry:
    item: OutItem
    response_id: str | None  # set for answer audio (either form) so barge-in can flush it
    samples: int  # 24 kHz samples of answer audio this entry carries
    on_taken: Callable[[], None] | None = None  # runs when the transport takes the item (it leaves the server)
    keep: bool = False  # a held item that discard() sends all the same


class Outbound:
    def __init__(self, maxsize: int, overflow_event: Callable[[], dict[str, Any]] | None = None) -> None:
        if maxsize < 1:
            raise ValueError(f"outbound queue size must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._q: deque[_Entry] = deque()
        self._wake = asyncio.Event()
        self._taken = asyncio.Event()
        self._closed = False
        self.overflowed = False
        self._overflow_event = overflow_event
        self._held: list[_Entry] | None = None  # hold(): what is put waits here until release() or discard()

    def __len__(self) -> int:
        return len(self._q)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: OutItem, response_id: str | None = None, samples: int = 0,
            on_taken: Callable[[], None] | None = None, keep: bool = False, now: bool = False) -> bool:
        """Queue an item; False if the stream is closed or just overflowed (and is now closing). `keep`: held, it is
        sent even if what was held is discarded; `now`: it goes out even while others are held."""
        if self._closed:
            return False
        if self._held is not None and not now and len(self._held) < self.maxsize:
            self._held.append(_Entry(item, response_id, samples, on_taken, keep))
            return True
        if len(self._q) >= self.maxsize:
            self.overflowed = True
            self._q.clear()
            if self._overflow_event is not None:
                self._q.append(_Entry(self._overflow_event(), None, 0))
            self.close()
            return False
        self._q.append(_Entry(item, response_id, samples, on_taken))
        self._wake.set()
        return True

    def hold(self) -> None:
        """What is put from now on waits (an answer that may yet be withdrawn: its events, and the turn end's),
        up to maxsize items; beyond that the stream overflows as it would have anyway."""
        if self._held is None:
            self._held = []

    @property
    def holding(self) -> bool:
        return self._held is not None

    def release(self) -> bool:
        """What was held goes out, in order, and puts go straight to the queue again; False if that overflowed."""
        held, self._held = self._held or [], None
        return all(self.put(e.item, e.response_id, e.samples, e.on_taken) for e in held)

    def discard(self) -> bool:
        """What was held is never sent, but for the items put with `keep`; puts go straight to the queue again.
        False if that overflowed."""
        held, self._held = self._held or [], None
        return all(self.put(e.item, e.response_id, e.samples, e.on_taken) for e in held if e.keep)

    def put_final(self, item: OutItem) -> None:
        """Queue one last item even when full (e.g. the error that explains a close), then close."""
        if self._closed:
            return
        self._q.append(_Entry(item, None, 0))
        self.close()

    def drop_audio(self, response_id: str) -> int:
        """Barge-in: remove queued answer audio of one response; returns the samples dropped."""
        kept: deque[_Entry] = deque()
        dropped = 0
        for e in self._q:
            if e.response_id == response_id and e.samples:
                dropped += e.samples
            else:
                kept.append(e)
        self._q = kept
        return dropped

    def close(self) -> None:
        """No more puts; `get()` drains what is queued, then returns None."""
        self._closed = True
        self._wake.set()
        self._taken.set()

    async def room(self) -> None:
        """Until the queue is at most half full (or closed)."""
        while len(self._q) > self.maxsize // 2 and not self._closed:
            self._taken.clear()
            await self._taken.wait()

    async def get(self) -> OutItem | None:
        while not self._q:
            if self._closed:
                return None
            self._wake.clear()
            await self._wake.wait()
        e = self._q.popleft()
        self._taken.set()
        if e.on_taken is not None:
            e.on_taken()
        return e.item


@dataclass
class Playback:
    """One answer's audio as it leaves the queue, heard by a listener playing it at real time from its first audio
    on, as the load test models one: the time to first audio, the underruns the server itself caused (a chunk
    leaving after that listener ran dry; network not counted), and how much of it the user has heard."""

    turn_start: float  # monotonic; TTFA starts at the commit that led to the answer (or at its creation)
    first_audio_at: float | None = None  # monotonic time the first audio left the queue
    played_reported: int | None = None  # track mode: samples played, reported by the transport
    ttfa_ms: float | None = None
    listener: PlaybackBuffer = field(default_factory=lambda: PlaybackBuffer(ANSWER_RATE, LISTENER_PREBUFFER_S))

    @property
    def samples_sent(self) -> int:
        """24 kHz samples of answer audio that have left the queue (the listener has been given them all)."""
        return self.listener.samples

    def taken(self, samples: int, observer: SessionObserver | None) -> None:
        """`samples` of the answer's audio left the queue (the transport took them)."""
        now = time.monotonic()
        if self.first_audio_at is None:
            self.first_audio_at = now
            self.ttfa_ms = (self.first_audio_at - self.turn_start) * 1000.0
            if observer is not None:
                observer.ttfa(self.ttfa_ms / 1000.0)
        heard, silent_s = self.listener.underruns, self.listener.stall_s
        self.listener.on_audio(now, samples)
        if self.listener.underruns > heard and observer is not None:
            observer.underrun(self.listener.stall_s - silent_s)

    def report_played(self, samples: int) -> None:
        """A track transport's count of the samples it has played."""
        self.played_reported = max(self.played_reported or 0, int(samples))

    def played(self) -> int:
        """24 kHz samples the user has heard: as the track transport reported; else the samples sent, capped by real
        time since the first audio (the client plays at real time)."""
        if self.played_reported is not None:
            return min(self.played_reported, self.samples_sent)
        if self.first_audio_at is None:
            return 0
        by_clock = int((time.monotonic() - self.first_audio_at) * ANSWER_RATE)
        return min(self.samples_sent, by_clock)
