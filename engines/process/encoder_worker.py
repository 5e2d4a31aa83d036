"""User speech into codes for the engine service: audio held per session and encoded for all sessions in batched
calls, on a thread of its own on a GPU so that the engine loop never waits for the speech encoder.

The engine loop hands over each session's PCM (`append`) and its commit (`commit`) and collects codes
(`take_results`, in the order they were produced; a commit's result is the last of its turn). What is due:
- Commits first: every committed session's stream is finalized, with the audio it still holds, in one call.
- Held audio of every session in one call (EncoderBatch), at most every `every_s` (0: as soon as it is held);
  the interval grows with the sessions holding audio (ENCODE_SESSIONS_PER_INTERVAL, up to ENCODE_MAX_EVERY_S), as
  a call's cost grows with them. While an answer waits for its first codes (`lm_ramping`, set by the loop), held
  audio waits up to ENCODE_DEFER_S: those codes decide that answer's time to first audio, a commit flushes
  whatever is held anyway, and the encoder's kernels would share the GPU with the decode steps.
A turn's codes, once committed, are the same however its audio is cut into calls (the encoder streams exactly, and
re-encodes where the floor changed). While a turn streams, its log-mel floor follows a running max; Whisper's is the
max over each whole 30 s segment: turns are encoded again where their floor changes (turn_floors.py): a segment the
turn passed the end of, in that call of held audio; the segment under way when its max rose, in a call of its own
once no commit or held audio is due (it rewinds the turn's stream); at a commit, what still differs. Their results
carry the codes that change.

`threaded`: the calls run on the worker's thread (the encoder's CUDA streams: commits on its high-priority one, held
audio on its lowest-priority one; its host sync through an event, which releases the GIL). Under load on an H200 the
encoder took a quarter of the engine loop's time there (76-108 sessions: 35-39 ms batched calls every ~0.3 s and a
12-14 ms commit per answer), and decode steps waited behind it. Without a thread (the CPU default, tests)
`run_due()` runs them on the caller's thread, between its steps. A commit that arrives during a call of held audio
waits for that call, then goes before the next one.

Streams are opened, stepped and closed only by the thread that runs the calls; a turn dropped (`drop`: the
session's audio cleared, the session closed) while in a call is closed after it, and none of its results reach
the loop after `drop` returns. An encoder call that fails fails its turns; any other error on the thread fails every
turn the worker holds (each session gets an error, a committing one as its commit's result) and the thread goes on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.process import turn_floors
from engines.process.observe.spans import Spans
from engines.process.worker_wait import wait_for_work

if TYPE_CHECKING:
    from engines.speech_in.segment_floor import Refloor, RefloorJob

log = logging.getLogger("engines.process")

ENCODE_DEFER_S = 0.3  # longest user audio is held back while an answer waits for its first codes
# A batched encoder call costs ~0.4 ms per session on top of its fixed cost (H200: ~10 ms for one session, 20-45 ms
# for 52-76), so with more sessions holding audio the interval grows (up to ENCODE_MAX_EVERY_S).
ENCODE_SESSIONS_PER_INTERVAL = 16
ENCODE_MAX_EVERY_S = 0.32


@dataclass(frozen=True)
class Encoded:
    """Codes of a session's user audio (or the encoder's exception); `commit`: its turn's last, stream finalized."""

    key: str
    codes: list[int] | Exception
    commit: bool
    at: float = 0.0  # time.monotonic() when the call ended (the engine loop collects it up to a step later)
    started: float = 0.0  # ... and when it began (before it a commit waits for the call in flight, held or a commit)
    refloor: Refloor | None = None  # its turn's codes with the whole-segment floor where they change (segment_floor.py)


@dataclass(eq=False)
class _Turn:
    """One session's user audio turn in the encoder."""

    key: str
    stream: Any = None  # the encoder's stream, opened by the first call that has audio for it
    held: list[np.ndarray] = field(default_factory=list)  # audio not yet encoded
    audio: list[np.ndarray] = field(default_factory=list)  # audio encoded so far (a commit encodes it again)
    floored: int = 0  # its 30 s segments already encoded again, as the turn passed their end
    rewound: tuple[int, float] | None = None  # (segment, peak) its stream was last rewound to (turn_floors.py)
    peak_seen: float = -math.inf  # its stream's running log-mel max when last checked
    rising: bool = False  # that max rose: its segment under way is due to be encoded again
    answered: bool = False  # committed tentatively: an answer may be under way; its floor waits (`resume`)
    commit: bool = False  # finalize it with the next commit call
    tentative: bool = False  # encode what it holds now and report it as a commit, keeping the stream open
    replying: bool = False  # taken by a call for its tentative commit: that call's result is the commit's
    dropped: bool = False


class EncoderWorker:
    """`encoder`: `open_stream()` -> stream with `push(pcm) -> codes`, `finalize(last) -> codes`, optionally `close()`;
    with `batch(urgent=True)` (engines.speech_in.EncoderBatch) several streams go in one call."""

    def __init__(self, encoder: Any, every_s: float = 0.0, threaded: bool = False, clock: Any = time.monotonic
                 ) -> None:
        self.encoder = encoder
        self.every_s = every_s
        self._clock = clock
        self._cv = threading.Condition()
        self._turns: dict[str, _Turn] = {}
        self._results: deque[Encoded] = deque()
        self._held_since: float | None = None  # when the oldest audio held arrived
        self._ramping = False
        self._running = False  # a call in flight
        self._in_call: dict[int, _Turn] = {}  # id -> turn taken by the call in flight, until its result is out
        self._closed = False
        self.spans = Spans()  # call times, taken by the load log (under _cv)
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="encoder-worker", daemon=True)
            self._thread.start()

    # ---- engine-loop side ----------------------------------------------------------------

    @property
    def threaded(self) -> bool:
        """The calls run on the worker's thread (else `run_due` runs them)."""
        return self._thread is not None

    @property
    def lm_ramping(self) -> bool:
        return self._ramping

    @lm_ramping.setter
    def lm_ramping(self, ramping: bool) -> None:
        """An answer waits for its first codes (held audio waits, at most ENCODE_DEFER_S)."""
        if ramping != self._ramping:
            with self._cv:
                self._ramping = ramping
                self._cv.notify_all()

    def append(self, key: str, pcm: np.ndarray) -> None:
        """More user audio (16 kHz float32) of this session's turn."""
        with self._cv:
            t = self._turns.get(key)
            if t is None:
                t = self._turns[key] = _Turn(key)
            if self._held_since is None:
                self._held_since = self._clock()
            t.held.append(pcm)
            self._cv.notify_all()

    def commit(self, key: str, final: bool = True) -> bool:
        """Finalize this session's turn as soon as possible; False if it has none (nothing was appended). Its last
        codes then come as a result with commit=True (an exception there is the encoder's failure).
        `final=False` (a tentative commit): the audio held is encoded at once and its codes come as that result,
        but the stream stays open, with the audio it keeps for its next code: more audio continues the same turn
        exactly, as if no commit had come (`drop` forgets it once the commit is confirmed)."""
        with self._cv:
            t = self._turns.get(key)
            if t is None:
                return False
            if final:
                t.commit = True
            else:
                t.tentative = True
            self._cv.notify_all()
            return True

    def resume(self, key: str) -> None:
        """The answer to this session's tentative commit was withdrawn and its turn goes on: its floor is set again
        while it is spoken (turn_floors.py)."""
        with self._cv:
            t = self._turns.get(key)
            if t is not None:
                t.answered = False

    def drop(self, key: str) -> None:
        """Forget this session's turn (its audio cleared, the session closed): no result of it comes any more."""
        with self._cv:
            t = self._turns.pop(key, None)
            self._results = deque(e for e in self._results if e.key != key)
            if t is None:
                return
            self._forget_held_since()
            t.dropped = True
            if id(t) not in self._in_call:  # a call in flight closes it after itself
                self._close(t)

    def holding(self, key: str) -> bool:
        """This session has audio not yet encoded."""
        with self._cv:
            t = self._turns.get(key)
            return t is not None and bool(t.held)

    def take_results(self) -> list[Encoded]:
        with self._cv:
            out = list(self._results)
            self._results.clear()
            return out

    def take_spans(self) -> dict[str, tuple[int, float, float]]:
        with self._cv:
            return self.spans.take()

    def busy(self) -> bool:
        """Audio held, a commit or call pending, or results not yet collected."""
        with self._cv:
            return self._running or bool(self._results) or any(
                t.held or t.commit or t.tentative or t.rising for t in self._turns.values())

    def run_due(self, flush: bool = False) -> bool:
        """Without a thread: run the call that is due now, if any (`flush`: held audio is due whatever the interval).
        Returns whether a call ran."""
        if self.threaded:
            raise RuntimeError("run_due is for an EncoderWorker without a thread")
        with self._cv:
            work = self._take_due(self._clock(), flush)
        if work is None:
            return False
        self._call(*work)
        return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- the calls -----------------------------------------------------------------------

    def _due_at(self, holding: int) -> float:
        """When held audio is due (given how many sessions hold some); +inf when none is held."""
        if self._held_since is None or not holding:
            return math.inf
        every = min(max(self.every_s, ENCODE_MAX_EVERY_S),
                    self.every_s * max(1, math.ceil(holding / ENCODE_SESSIONS_PER_INTERVAL)))
        return self._held_since + (max(every, ENCODE_DEFER_S) if self._ramping else every)

    def _take_due(self, now: float, flush: bool) -> tuple[str, list[tuple[_Turn, np.ndarray]]] | None:
        """(kind, [(turn, its held audio)]) of the call due now (under _cv), recorded as in the call; None if none
        is. Kinds: "commit", "held" (tentative commits go in one, their streams go on, right after the final
        commits), "rewind" (turn_floors.py: when nothing else is due)."""
        commits = [t for t in self._turns.values() if t.commit]
        tentative = [t for t in self._turns.values() if t.tentative and not t.commit]
        holding = self._holding()
        rising = [t for t in self._turns.values() if t.rising]
        if commits:
            taken, kind = commits, "commit"
            for t in commits:
                del self._turns[t.key]  # a commit ends its turn; the session's next audio starts another
            self._forget_held_since()
        elif tentative:
            taken, kind = tentative, "held"
            for t in tentative:
                t.tentative, t.replying, t.answered = False, True, True
            self._forget_held_since()
        elif holding and (flush or self._due_at(len(holding)) <= now):
            taken, kind = holding, "held"
            self._held_since = None  # audio arriving from now on waits for the next call
        elif rising:
            taken, kind = rising, "rewind"
            for t in rising:
                t.rising = False  # (one try: a rewind that finds no slot leaves the floor to the commit)
        else:
            return None
        self._running = True
        self._in_call.update((id(t), t) for t in taken)  # first: a commit's turn is no longer in _turns
        if kind == "rewind":
            return kind, [(t, np.zeros(0, np.float32)) for t in taken]  # (their held audio stays held)
        work = []
        for t in taken:
            pcm = t.held[0] if len(t.held) == 1 else np.concatenate(t.held) if t.held else np.zeros(0, np.float32)
            t.held = []
            t.audio.append(pcm)
            work.append((t, pcm))
        return kind, work

    def _holding(self) -> list[_Turn]:
        """The turns whose held audio goes with the next call of held audio (a committing one goes with its commit)."""
        return [t for t in self._turns.values() if t.held and not t.commit]

    def _forget_held_since(self) -> None:
        """No audio is held any more (the last holder committed or was dropped): the next to arrive starts the wait."""
        if not any(t.held for t in self._turns.values()):
            self._held_since = None

    def _call(self, kind: str, work: list[tuple[_Turn, np.ndarray]]) -> None:
        """One encoder call for these turns (outside _cv), then their results."""
        t0, cpu0, started = time.perf_counter(), time.thread_time(), time.monotonic()
        commit = kind == "commit"
        codes: list = [[] for _ in work]
        if kind != "rewind":
            try:
                codes = self._encode(commit, work)
            except Exception as e:  # noqa: BLE001 - handed back: the Service fails those sessions' audio turns
                codes = [e] * len(work)
        floors = self._refloor(kind, work, codes)
        dt, cpu, at = time.perf_counter() - t0, time.thread_time() - cpu0, time.monotonic()
        with self._cv:
            for (t, _), c, floor in zip(work, codes, floors, strict=True):
                self._in_call.pop(id(t), None)
                failed = isinstance(c, Exception)
                as_commit, t.replying = commit or t.replying, False
                if failed and self._turns.get(t.key) is t:
                    del self._turns[t.key]  # the stream's state is unknown: this turn is over
                if t.dropped or failed or commit:
                    self._close(t)
                if not t.dropped and (as_commit or failed or c or floor is not None):
                    self._results.append(Encoded(t.key, c, as_commit, at, started, floor))
            name = {"commit": "encode commits", "held": "encode", "rewind": "encode rewind"}[kind]
            self.spans.add(name, dt)
            # What the call's wall time was made of, as for the codec's rounds: this thread's CPU time and the wait
            # for the GPU (an event wait that spins counts in both); the rest went waiting for the GIL.
            self.spans.add(name + " cpu", cpu)
            if hasattr(self.encoder, "last_gpu_wait_s"):
                self.spans.add(name + " gpu wait", self.encoder.last_gpu_wait_s)
            self._running = False
            self._cv.notify_all()

    def _refloor(self, kind: str, work: list[tuple[_Turn, np.ndarray]], codes: list) -> list[Refloor | None]:
        """Each turn's codes with the whole-segment floor where they change (turn_floors.py): the re-encodes due after
        this call, all the turns of a call in one batched encoder call (one for a commit's, urgent, one for the
        others). None for a turn whose codes stand: none changes, the encoder has no such call, or it failed (a turn
        whose stream was rewound then fails: its `codes` become the error)."""
        floors: list[Refloor | None] = [None] * len(work)
        many = getattr(self.encoder, "refloor_many", None)
        if many is None:
            return floors
        commit = kind == "commit"
        groups: dict[bool, list[tuple[int, _Turn, RefloorJob]]] = {True: [], False: []}
        speaking = []
        for i, ((t, _), c) in enumerate(zip(work, codes, strict=True)):
            if isinstance(c, Exception):
                continue
            at_commit = commit or t.replying
            job = turn_floors.job_for(self.encoder, t, commit, at_commit or kind == "rewind")
            if job is not None:
                groups[at_commit].append((i, t, job))
            elif kind == "held" and not at_commit and not t.answered:
                speaking.append(t)
        if commit:
            for t, _ in work:
                self._close(t)  # finalized: their slots serve the re-encode's streams
        for urgent, group in groups.items():
            if not group:
                continue
            t0 = time.perf_counter()
            try:
                out = turn_floors.run_group(many, [job for *_, job in group], urgent)
            except Exception as e:  # noqa: BLE001 - the running floor's codes are still valid turns
                log.exception("speech encoder: re-encoding %d turns with their segment floor failed", len(group))
                for i, _, job in group:
                    if job.stream is not None:
                        codes[i] = e
                continue
            for (i, t, job), r in zip(group, out, strict=True):
                if not isinstance(r, Exception):  # (no slot for it: it is due again after the next call)
                    floors[i] = r
                    turn_floors.after(t, job, r)
            if kind != "rewind":  # (a rewind call's own span is its time)
                with self._cv:
                    self.spans.add("encode refloor" if urgent else "encode refloor held", time.perf_counter() - t0)
        turn_floors.rose(self.encoder, speaking)
        return floors

    def _encode(self, commit: bool, work: list[tuple[_Turn, np.ndarray]]) -> list[list[int]]:
        live = [(t, pcm) for t, pcm in work if t.stream is not None or pcm.size]
        for t, _ in live:
            if t.stream is None:
                t.stream = self.encoder.open_stream()
        batched = len(live) > 1 and hasattr(self.encoder, "batch")
        if commit:
            if batched:
                out = self.encoder.batch().finalize([t.stream for t, _ in live], [pcm for _, pcm in live])
            else:
                out = [t.stream.finalize(pcm) for t, pcm in live]
        elif hasattr(self.encoder, "batch"):  # not urgent: the answers waiting are waiting for commits, not this
            out = self.encoder.batch(urgent=False).step([(t.stream, pcm) for t, pcm in live])
        else:
            out = [t.stream.push(pcm) for t, pcm in live]
        by_turn = {id(t): list(c) for (t, _), c in zip(live, out, strict=True)}
        return [by_turn.get(id(t), []) for t, _ in work]  # a commit of a turn that never had audio: no codes

    def _close(self, t: _Turn) -> None:
        stream, t.stream = t.stream, None
        if stream is not None and hasattr(stream, "close") and not getattr(stream, "closed", False):
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - its slot may leak; the turn is over either way
                log.exception("speech encoder: closing session %s's stream failed", t.key)

    def _run(self) -> None:
        while True:
            try:
                with self._cv:
                    work = wait_for_work(self._cv, lambda: self._closed, lambda now: self._take_due(now, False),
                                         lambda _: self._due_at(len(self._holding())), self._clock, 0.0005)
                if work is None:
                    return
                self._call(*work)
            except Exception as e:  # noqa: BLE001 - the thread must live on: sessions would wait for it forever
                log.exception("speech encoder worker: unexpected error; every turn it holds fails")
                self._fail_all(e)
                time.sleep(0.05)  # (an error that repeats is not logged in a tight loop)

    def _fail_all(self, e: Exception) -> None:
        """After an error outside the encoder's own calls (whose failures `_call` hands back per turn): every turn
        held or in the call fails with `e` (a committing one as its commit's result), and the worker starts over."""
        with self._cv:
            turns = {id(t): t for t in (*self._turns.values(), *self._in_call.values())}  # a turn in both once
            for t in turns.values():
                if not t.dropped:
                    now = time.monotonic()
                    self._results.append(Encoded(t.key, e, t.commit, now, now))
                self._close(t)
            self._turns.clear()
            self._in_call.clear()
            self._held_since = None
            self._running = False
            self._cv.notify_all()
