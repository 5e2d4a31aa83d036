"""KV block pool shared by all attention layers.

A sequence's block table is the same in every layer, so one pool of block ids serves the 40
layers of the cache tensor. Blocks are reference counted so a conversation's history stays
cached between turns, and admission works by reservation: a request is admitted only if every
block it may ever need (history + prompt + output budget) can be set aside, so a running
stream never waits for memory and is never preempted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class KVIntegrityError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refcount = [0] * num_blocks
        self.reserved = 0  # blocks promised to admitted sequences but not yet handed out

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_available(self) -> int:
        """Free blocks nobody has reserved: what a new admission may claim."""
        return len(self._free) - self.reserved

    def reserve(self, n: int) -> bool:
        if n < 0:
            raise ValueError(f"cannot reserve {n} blocks")
        if n > self.num_available:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        if not 0 <= n <= self.reserved:
            raise KVIntegrityError(f"unreserve {n} with only {self.reserved} reserved")
        self.reserved -= n

    def allocate_reserved(self, n: int) -> list[int]:
        """Hand out n blocks from an earlier reservation."""
        if n > self.reserved or n > len(self._free):
            raise KVIntegrityError(f"allocate {n} blocks: reserved {self.reserved}, free {len(self._free)}")
        self.reserved -= n
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refcount[b] <= 0:
                raise KVIntegrityError(f"incref of free block {b}")
            self._refcount[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refcount[b] <= 0:
                raise KVIntegrityError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def check_integrity(self, tables: Iterable[list[int]], reserved_by_owners: int | None = None) -> None:
        """free + used == total; each block's refcount equals the tables holding it; no block free and held."""
        held = Counter(b for t in tables for b in t)
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVIntegrityError("a block appears twice in the free list")
        problems = []
        for b in range(self.num_blocks):
            if b in free and (held[b] or self._refcount[b]):
                problems.append(f"block {b} is free but held by {held[b]} tables (refcount {self._refcount[b]})")
            elif b not in free and self._refcount[b] != held[b]:
                problems.append(f"block {b}: refcount {self._refcount[b]} but held by {held[b]} tables")
        if len(free) + sum(1 for b in range(self.num_blocks) if b not in free) != self.num_blocks:
            problems.append("free + used != total")
        if self.reserved > len(self._free):
            problems.append(f"reserved {self.reserved} exceeds free {len(self._free)}")
        if reserved_by_owners is not None and reserved_by_owners != self.reserved:
            problems.append(f"pool reserved {self.reserved} != sum of owners' reservations {reserved_by_owners}")
        if problems:
            raise KVIntegrityError("; ".join(problems[:10]))
