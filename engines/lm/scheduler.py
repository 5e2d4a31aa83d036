"""Continuous batching with chunked prefill and admission by reservation.

Every step: all generating sequences decode one row; the rest of the row budget goes to prefill
chunks: running sequences with pending input (complete inputs first, then open ones, oldest first in
each), then newly admitted ones. While a sequence is in its first few generated rows (a new answer),
the step's rows are capped (EngineConfig.ramp_step_rows): a long prefill would lengthen every step that
answer's first audio waits on. Complete inputs are outside the cap: their answers come next and wait on them as much
(docs/performance.md, natural speech). A request
is admitted only when its whole KV need (history + prompt + output budget) can be reserved, so
nothing running is ever preempted. Aborts take effect at the next step boundary.

The blocks of idle conversations' histories go back to the pool only when a conversation is truncated or
released. A request whose need exceeds what could ever be free without that (the free blocks nobody reserved, plus
what the running sequences give back when they finish) is refused: at `add` with
QueueFullError, and, when that changes later (a request waiting grew, the running ones used their reservations),
at the next `schedule` with finish reason "no_kv", so that it never waits forever, nor the requests behind it.

Background work (Sequence.low_until: input transcriptions, a conversation's re-prefill after it was cut to fit its
context) takes only the rows a step has left after everything else, in no step that runs an answer's first rows or
ends a prompt, and a background request is admitted only when no other request waits and an eighth of the slots
stays free: an answer's chunks are the same with or without it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engines.api import (
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
    SamplingParams,
)
from engines.config import EngineConfig
from engines.lm.kv.block_pool import BlockPool
from engines.lm.kv_room import KvRoom
from engines.lm.sequence import Conversation, Sequence, blocks_for
from engines.tokens import Row

# Prefill rows a step still carries while an answer ramps (EngineConfig.ramp_step_rows), however many sequences
# decode: speaking users' rows and other prompts keep moving.
RAMP_MIN_PREFILL = 16

# Why Scheduler.schedule_ahead gave no step (the step after then waits for the host to read the tokens): an abort is
# pending; a chunk in flight is not where its sequence is; a generated row in flight is text (its successor's input
# is decided on the host); a prompt ends whose first row is text; nothing would decode; a generating sequence is not
# in the step; prefill beside decodes with no answer ramping (deliberate: the next step gathers more rows).
# Background work waits while nothing ramps (a normal step runs it).
AHEAD_REFUSALS = ("abort", "stale", "text row", "text prompt", "no decode", "a decode left out", "prefill, no ramp",
                  "background")
BACKGROUND_ALL = 1 << 62  # Sequence.low_until of a background request


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_rows: int  # rows run this step: seq.rows[start:start+num_rows]
    start: int
    needs_logits: bool  # the chunk ends the prompt (or is a decode row): sample after it
    stale: bool = False  # launched ahead, its rows were rewritten since (Engine.rewrite_input): dropped


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    finished: list[Sequence]  # aborted or refused ("no_kv") since the last step, emitted with their finish_reason

    @property
    def num_rows(self) -> int:
        return sum(c.num_rows for c in self.chunks)


class Scheduler(KvRoom):
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.conversations: dict[str, Conversation] = {}
        self._aborts: set[str] = set()
        self._free_slots = list(range(config.max_running - 1, -1, -1))
        self._arrivals = 0
        self.ahead_refusal: str | None = None  # why the last schedule_ahead gave no step (AHEAD_REFUSALS)
        # The samples (places among the in-flight step's) whose sequences the last step given by schedule_ahead
        # leaves out: they end in flight. Its decode rows take the other samples, in order.
        self.ahead_ending: list[int] = []

    # ---- requests ------------------------------------------------------------------------

    def add(self, request_id: str, rows: list[Row], params: SamplingParams, seed: int,
            conversation_id: str | None, input_done: bool, background: bool = False,
            refill_rows: int = 0, ramp_rows: int | None = None) -> Sequence:
        """`background`: the whole request is background work (it must not extend a conversation); `refill_rows`: the
        first rows of `rows` are (history re-run after a cut); `ramp_rows`: Sequence.ramp_rows (None: the config's)."""
        if background and conversation_id is not None:
            raise InvalidRequestError("a background request cannot extend a conversation")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already live")
        if not rows and conversation_id is None:
            raise InvalidRequestError("a request needs at least one row")
        conv = None
        history: list[Row] = []
        if conversation_id is not None:
            conv = self.conversations.get(conversation_id)
            if conv is None:
                conv = Conversation(conversation_id)
            elif conv.busy:
                raise InvalidRequestError(f"conversation {conversation_id!r} already has a live request")
            history = conv.rows
        if not history and not rows:
            raise InvalidRequestError("a request needs at least one row")
        total = len(history) + len(rows) + params.max_new_tokens
        if total > self.config.max_model_len:
            raise RequestTooLargeError(
                f"history {len(history)} + prompt {len(rows)} + max_new_tokens {params.max_new_tokens} rows "
                f"exceed max_model_len {self.config.max_model_len}")
        if blocks_for(total, self.block_size) > self.pool.num_blocks:
            raise RequestTooLargeError(
                f"{total} rows need {blocks_for(total, self.block_size)} KV blocks; "
                f"the pool has {self.pool.num_blocks}")
        # A waiting background request takes no answer's place in the queue (it is refused first).
        waiting = len(self.waiting) if background else sum(not q.background_request for q in self.waiting)
        if waiting >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        need = blocks_for(total, self.block_size) - (len(conv.block_ids) if conv is not None else 0)
        if need > self._obtainable():
            raise QueueFullError(self._no_kv_message(need))
        seq = Sequence(
            request_id=request_id, params=params, seed=seed, rows=history + list(rows),
            num_computed=conv.num_computed if conv else 0, block_ids=conv.block_ids if conv else [],
            prompt_len=len(history) + len(rows), input_done=input_done, conversation=conv,
            low_until=BACKGROUND_ALL if background else len(history) + min(refill_rows, len(rows)),
            background_request=background, ramp_rows=self.config.ramp_rows if ramp_rows is None else ramp_rows,
        )
        if conv is not None:
            conv.busy = True
            self.conversations[conversation_id] = conv
        self.requests[request_id] = seq
        self.waiting.append(seq)
        return seq

    def append_input(self, request_id: str, rows: list[Row], input_done: bool,
                     params: SamplingParams | None = None, seed: int | None = None,
                     ramp_rows: int | None = None) -> None:
        """More prompt rows for a request whose input is still open; `params` replaces its sampling
        settings (the reservation follows the new output budget); `ramp_rows` its Sequence.ramp_rows."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finish_reason is not None or request_id in self._aborts:
            raise InvalidRequestError(f"no live request {request_id!r}")
        if seq.input_done:
            raise InvalidRequestError(f"request {request_id!r} already has its whole input")
        new_params = params or seq.params
        total = len(seq.rows) + len(rows) + new_params.max_new_tokens
        if total > self.config.max_model_len:
            raise RequestTooLargeError(f"{total} rows exceed max_model_len {self.config.max_model_len}")
        if seq.slot >= 0:  # admitted: its reservation follows the prompt and the output budget
            extra = blocks_for(total, self.block_size) - len(seq.block_ids) - seq.reserved_blocks
            if extra > 0:
                if not self.pool.reserve(extra):
                    raise QueueFullError(f"KV cache cannot hold {len(rows)} more rows for {request_id!r}")
                seq.reserved_blocks += extra
            elif extra < 0:
                self.pool.unreserve(-extra)
                seq.reserved_blocks += extra
        seq.params = new_params
        if seed is not None:
            seq.seed = seed
        if ramp_rows is not None:
            seq.ramp_rows = ramp_rows
        seq.rows.extend(rows)
        seq.prompt_len = len(seq.rows)
        seq.input_done = input_done

    def rewrite_input(self, request_id: str, start: int, rows: list[Row]) -> int:
        """Rows from `start` of a request that has generated nothing replaced, their KV rolled back (its blocks stay;
        a chunk over them in a step launched ahead must be marked stale). Returns the rows to run again."""
        seq = self.requests.get(request_id)
        if (seq is None or seq.finish_reason is not None or request_id in self._aborts or seq.num_generated
                or not 0 <= start <= start + len(rows) <= len(seq.rows)):
            raise InvalidRequestError(f"cannot rewrite rows from {start} of {request_id!r}: no such rows unanswered")
        seq.rows[start:start + len(rows)] = rows
        redone, seq.num_computed = max(0, seq.num_computed - start), min(seq.num_computed, start)
        seq.history_marked = False  # the repetition history is rebuilt from the rows before its next chunk
        return redone

    def abort(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        if seq is None or seq.finish_reason is not None:
            return False
        self._aborts.add(request_id)
        return True

    def aborting(self, request_id: str) -> bool:
        """Abort asked for, not yet applied (it is applied by the next `schedule`)."""
        return request_id in self._aborts

    # ---- the step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Something to run or report: waiting requests, pending aborts, or running rows to compute."""
        return bool(self.waiting or self._aborts or any(q.generating or q.num_pending for q in self.running))

    def schedule(self) -> SchedulerOutput:
        finished = self._apply_aborts()
        finished += self._refuse_unadmittable()
        cfg = self.config
        budget = cfg.prefill_token_budget
        chunks: list[ScheduledChunk] = []
        # Decodes first: one row per generating sequence, never starved by prefill.
        for seq in self.running:
            if seq.generating and not seq.background:
                chunks.append(ScheduledChunk(seq, 1, seq.num_computed, True))
                budget -= 1
        full = budget
        budget = self._ramp_capped(budget, len(chunks), any(c.seq.num_generated < c.seq.ramp_rows for c in chunks))
        budget = self._add_prefills(chunks, {}, budget, complete_budget=full)
        budget = self._admit(chunks, budget)
        if not any(self._starts_answer(c) for c in chunks):
            for seq in self.running:
                if seq.generating and seq.background and budget > 0:
                    chunks.append(ScheduledChunk(seq, 1, seq.num_computed, True))
                    budget -= 1
            self._admit(chunks, self._add_prefills(chunks, {}, budget, background=True), background=True)
        for c in chunks:
            self._ensure_blocks(c.seq, c.start + c.num_rows)
        return SchedulerOutput(chunks, finished)

    def _starts_answer(self, c: ScheduledChunk) -> bool:
        """The chunk samples one of an answer's first rows (not background work's)."""
        return c.needs_logits and not c.seq.background_request and c.seq.num_generated < c.seq.ramp_rows

    def _next_waiting(self, background: bool) -> Sequence | None:
        """The oldest waiting request of the kind; a background one only when no other waits."""
        first = next((s for s in self.waiting if not s.background_request), None)
        if not background:
            return first
        return None if first is not None else (self.waiting[0] if self.waiting else None)

    def _admit(self, chunks: list[ScheduledChunk], budget: int, background: bool = False) -> int:
        """Admit waiting requests, oldest first, while their reservation fits, each with a prefill chunk of its
        rows within `budget` (of its background rows only with `background`). Returns the budget left."""
        while budget > 0 and len(self.running) < self.config.max_running:
            seq = self._next_waiting(background)
            if seq is None or (seq.background_request and not self._background_room()):
                break
            need = seq.blocks_needed(self.block_size)
            if not self.pool.reserve(need):
                break  # FIFO: nothing jumps the queue
            self.waiting.remove(seq)
            seq.reserved_blocks = need
            seq.slot = self._free_slots.pop()
            seq.arrival = self._arrivals
            self._arrivals += 1
            self.running.append(seq)
            if seq.num_pending > 0 and (background or not seq.background):
                budget -= self._add_prefill(chunks, seq, budget)
        return budget

    def schedule_ahead(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk] | None:
        """The step after `chunks` (launched, tokens not read yet), or None when it cannot be known without those
        tokens (why: `ahead_refusal`). Its decode rows come first, one per chunk of `chunks` that samples: each such
        chunk must be an audio-mode decode, or the last chunk of a complete prompt whose first row will be audio
        (each then decodes one more row, whose input is the in-flight sample: Engine._launch); a sequence whose
        in-flight row is its last by length gets none (it ends there whatever that row holds). Then prefill rows
        known on the host: running sequences' pending rows after those in flight, complete inputs first, within the
        step budget (as `schedule`); while a new answer ramps, waiting requests are admitted there too, so that one
        arriving then neither waits for a step launched after these tokens are read nor makes the ramping answers
        wait for that launch. Nothing may be aborted (a normal step aborts), and every generating sequence must be
        among the decodes or end in flight. A row whose assumption turns out wrong (its sequence ended, switched
        modes or was aborted) is dropped by Engine._emit; its KV write is then beyond its computed rows, or
        rewritten as is."""
        self.ahead_refusal, self.ahead_ending = None, []
        if self._aborts:
            return self._refuse("abort")
        running = {id(s) for s in self.running}
        decodes: list[ScheduledChunk] = []
        inflight: dict[int, int] = {}  # id(seq) -> its first row not in flight
        ending: dict[int, int] = {}  # id(seq) -> its sample's place among `chunks`' samples: its in-flight row is
        # its last (max_new_tokens), or it is background work (a normal step runs its next rows)
        for c in chunks:
            s = c.seq
            if id(s) not in running or s.num_computed != c.start or c.stale:
                return self._refuse("stale")
            inflight[id(s)] = c.start + c.num_rows
            if not c.needs_logits:
                continue
            if s.background or s.num_generated + 1 >= s.params.max_new_tokens:
                ending[id(s)] = len(decodes) + len(ending)
                continue
            if s.generating:
                if not (c.num_rows == 1 and self.audio_row_holds(c)):
                    return self._refuse("text row")
            elif not (s.input_done and s.num_generated == 0 and c.start + c.num_rows == len(s.rows)
                      and s.first_mode() == "audio"):
                return self._refuse("text prompt")
            decodes.append(ScheduledChunk(s, 1, c.start + c.num_rows, True))
        ahead = {id(c.seq) for c in decodes} | set(ending)
        if not decodes:
            return self._refuse("no decode")
        if any(s.generating and id(s) not in ahead and not s.background for s in self.running):
            return self._refuse("a decode left out")
        out = list(decodes)
        cfg = self.config
        if self.ramps_after(decodes):
            full = cfg.prefill_token_budget - len(decodes)
            budget = self._ramp_capped(full, len(decodes), True)
            self._admit(out, self._add_prefills(out, inflight, budget, complete_budget=full))
        elif self._background_due(inflight):
            return self._refuse("background")
        elif self.waiting or len(decodes) != len(self.running) - len(ending):
            # Beside prefill, only while a new answer ramps (its first audio waits on every step): otherwise the
            # host's turn between steps lets the next one gather more rows, in fewer steps each reading all the
            # weights, and leaves the GPU to the codec meanwhile (H200, 132 sessions: ungated, 30% more steps).
            return self._refuse("prefill, no ramp")
        for c in out:
            self._ensure_blocks(c.seq, c.start + c.num_rows)
        self.ahead_ending = list(ending.values())  # (in order: places were given as the samples came)
        return out

    def ramps_after(self, chunks: list[ScheduledChunk]) -> bool:
        """Some chunk of a step in flight samples a row after which its answer is still in its first `ramp_rows`."""
        return any(c.needs_logits and not c.seq.background_request and c.seq.num_generated + 1 < c.seq.ramp_rows
                   for c in chunks)

    def _background_room(self) -> bool:
        """A background request may take a slot: an eighth of them stays free for answers."""
        return self.config.max_running - len(self.running) > self.config.max_running // 8

    def _background_due(self, inflight: dict[int, int]) -> bool:
        """Background work waits for a normal step: a background request waiting with room for it, or a running
        sequence's background rows not in flight (a background decode's input is decided on the host)."""
        return (self._background_room() and any(s.background_request for s in self.waiting)) or any(
            s.background and (s.generating or len(s.rows) > inflight.get(id(s), s.num_computed))
            for s in self.running)

    def _refuse(self, why: str) -> None:  # (AHEAD_REFUSALS)
        self.ahead_refusal = why
        return None

    def ahead_row_holds(self, c: ScheduledChunk, decode: bool) -> bool:
        """A chunk of a step launched ahead still stands: its decode row's assumption holds (`audio_row_holds`), or
        its prefill rows follow the sequence's computed rows and the sequence lives on."""
        if decode:
            return self.audio_row_holds(c)
        s = c.seq
        return s.finish_reason is None and s.num_computed == c.start and not (c.stale or self.aborting(s.request_id))

    def audio_row_holds(self, c: ScheduledChunk) -> bool:
        """The assumption a step launched ahead makes about its row still holds: the sequence is live and not
        being aborted, every row before this one was kept, and it is still in audio mode."""
        s = c.seq
        return (s.finish_reason is None and s.num_computed == c.start and s.mode == "audio"
                and not self.aborting(s.request_id))

    def _ramp_capped(self, budget: int, decodes: int, ramping: bool) -> int:
        """The step's prefill budget, capped while an answer ramps (EngineConfig.ramp_step_rows)."""
        cfg = self.config
        if cfg.ramp_step_rows and ramping:
            return min(budget, max(cfg.ramp_step_rows - decodes, RAMP_MIN_PREFILL))
        return budget

    def _add_prefills(self, chunks: list[ScheduledChunk], inflight: dict[int, int], budget: int,
                      background: bool = False, complete_budget: int | None = None) -> int:
        """Prefill chunks of running sequences with rows to run, within `budget`: those whose input is complete
        first (they answer next), then open inputs (users still speaking), oldest first in each. A sequence's rows
        start after those in flight (`inflight`: id(seq) -> its first row not in flight; a step launched ahead).
        Sequences already in `chunks`, generating ones and those of the other kind (`background`) are left out.
        Complete inputs may use `complete_budget` (default `budget`): a ramp cap leaves their rows out of it, since
        their answers wait on them as much as the ramping answer waits on its steps. Returns the budget left."""
        taken = {id(c.seq) for c in chunks}
        pending = [s for s in self.running if id(s) not in taken and not s.generating and s.background == background
                   and len(s.rows) > inflight.get(id(s), s.num_computed)]
        full = budget if complete_budget is None else max(budget, complete_budget)
        used = 0
        for seq in [s for s in pending if s.input_done]:
            if full - used <= 0:
                break
            used += self._add_prefill(chunks, seq, full - used, inflight.get(id(seq), seq.num_computed))
        budget = max(budget - used, 0)
        for seq in [s for s in pending if not s.input_done]:
            if budget <= 0:
                break
            budget -= self._add_prefill(chunks, seq, budget, inflight.get(id(seq), seq.num_computed))
        return budget

    def _add_prefill(self, chunks: list[ScheduledChunk], seq: Sequence, budget: int, start: int | None = None) -> int:
        start = seq.num_computed if start is None else start
        n = min(len(seq.rows) - start, budget)
        chunks.append(ScheduledChunk(seq, n, start, start + n == len(seq.rows) and seq.input_done))
        return n

    def _ensure_blocks(self, seq: Sequence, rows: int) -> None:
        need = blocks_for(rows, self.block_size) - len(seq.block_ids)
        if need > 0:
            seq.block_ids.extend(self.pool.allocate_reserved(need))
            seq.reserved_blocks -= need

    def _apply_aborts(self) -> list[Sequence]:
        out = []
        for rid in sorted(self._aborts):
            seq = self.requests.get(rid)
            if seq is None or seq.finish_reason is not None:
                continue
            seq.finish_reason = "abort"
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.finish(seq)
            out.append(seq)
        self._aborts.clear()
        return out

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence: its history stays with its conversation, everything else returns to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1
        self.pool.unreserve(seq.reserved_blocks)
        seq.reserved_blocks = 0
        conv = seq.conversation
        if conv is not None:
            conv.rows = seq.rows
            conv.num_computed = seq.num_computed
            conv.block_ids = seq.block_ids
            conv.busy = False
        else:
            self.pool.release(seq.block_ids)
        seq.block_ids = []
        self.requests.pop(seq.request_id, None)
