"""Room in the KV pool for a waiting request (Scheduler, scheduler.py's module doc): the blocks of idle
conversations' histories go back to the pool only when a conversation is truncated or released (both here), so a
request whose need exceeds what could ever be free without that is refused rather than left waiting forever. And the
pool's integrity check over every block table."""

from __future__ import annotations

from collections import deque

from engines.api import InvalidRequestError
from engines.lm.kv.block_pool import BlockPool
from engines.lm.sequence import Conversation, Sequence, blocks_for


class KvRoom:
    """Part of Scheduler (scheduler.py): what a waiting request could ever reserve, and the requests next in line
    that never could; idle conversations truncated or released. Calls Scheduler's _next_waiting and finish."""

    pool: BlockPool
    block_size: int
    waiting: deque[Sequence]
    running: list[Sequence]
    conversations: dict[str, Conversation]
    requests: dict[str, Sequence]

    def _obtainable(self) -> int:
        """Blocks a waiting request could ever reserve while every conversation keeps its history: those free and
        unreserved, and what the running sequences give back when they finish (their reservations; all their blocks
        for one without a conversation)."""
        return self.pool.num_available + sum(s.reserved_blocks + (len(s.block_ids) if s.conversation is None else 0)
                                             for s in self.running)

    def _no_kv_message(self, need: int) -> str:
        held = sum(len(c.block_ids) for c in self.conversations.values() if not c.busy)
        return (f"the KV pool has no room for this request ({need} blocks; {self._obtainable()} are free or will be "
                f"when the running requests end, {held} of {self.pool.num_blocks} hold other conversations' histories)")

    def _refuse_unadmittable(self) -> list[Sequence]:
        """The requests next in line that could never be admitted (module doc): retired, "no_kv". Next in line are
        the oldest request and the oldest answer (a background request waits behind every answer, so one it cannot
        admit holds up no answer, and is refused only for itself)."""
        out = []
        while True:
            heads = {id(q): q for q in (self._next_waiting(False), self.waiting[0] if self.waiting else None)
                     if q is not None}
            doomed = [q for q in heads.values() if q.blocks_needed(self.block_size) > self._obtainable()]
            if not doomed:
                return out
            for seq in doomed:
                self.waiting.remove(seq)
                seq.finish_reason = "no_kv"
                self.finish(seq)
                out.append(seq)

    # ---- conversations -------------------------------------------------------------------

    def truncate_conversation(self, conversation_id: str, num_rows: int) -> None:
        conv = self._idle_conversation(conversation_id)
        if not 0 <= num_rows <= len(conv.rows):
            raise InvalidRequestError(f"cannot truncate {len(conv.rows)} rows to {num_rows}")
        keep = blocks_for(num_rows, self.block_size)
        self.pool.release(conv.block_ids[keep:])
        conv.block_ids = conv.block_ids[:keep]
        conv.rows = conv.rows[:num_rows]
        conv.num_computed = min(conv.num_computed, num_rows)

    def release_conversation(self, conversation_id: str) -> None:
        conv = self._idle_conversation(conversation_id)
        self.pool.release(conv.block_ids)
        del self.conversations[conversation_id]

    def _idle_conversation(self, conversation_id: str) -> Conversation:
        conv = self.conversations.get(conversation_id)
        if conv is None:
            raise InvalidRequestError(f"unknown conversation {conversation_id!r}")
        if conv.busy:
            raise InvalidRequestError(f"conversation {conversation_id!r} has a live request")
        return conv

    def check_integrity(self) -> None:
        tables = [s.block_ids for s in self.requests.values()]
        tables += [c.block_ids for c in self.conversations.values() if not c.busy]
        self.pool.check_integrity(tables, sum(s.reserved_blocks for s in self.requests.values()))
