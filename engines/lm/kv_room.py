"""Room in the KV pool for a waiting request (Scheduler, scheduler.py's module doc): the blocks of idle
conversations' histories go back to the pool only when a conversation is truncated or released, so a request whose
need exceeds what could ever be free without that is refused rather than left waiting forever."""

from __future__ import annotations

from collections import deque

from engines.lm.kv.block_pool import BlockPool
from engines.lm.sequence import Conversation, Sequence


class KvRoom:
    """Part of Scheduler (scheduler.py): what a waiting request could ever reserve, and the requests next in line
    that never could. Calls Scheduler's _next_waiting and finish."""

    pool: BlockPool
    block_size: int
    waiting: deque[Sequence]
    running: list[Sequence]
    conversations: dict[str, Conversation]

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
