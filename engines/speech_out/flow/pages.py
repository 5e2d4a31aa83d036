"""The estimator's key/value pages: what every earlier chunk of a decode contributes to the attention of later ones.

The chunk-streaming flow attends, at every Euler step, in every transformer block of its estimator and for both the
conditional and unconditional pass, over every earlier chunk of the prompt and the answer. Those keys and values are
computed once, when their chunk is decoded, and kept here: one page per chunk of mel frames (a page is one chunk, so a
chunk's frames are always one page). Pages are refcounted: a voice's prompt pages are shared by every answer in that
voice.

A page holds [steps, blocks, 2 (k, v), 2 (conditional, unconditional), frames, width] values: 43.8 MiB in bf16 for the
real configuration (10 x 2 x 56 x 2 x 20 x 512), i.e. 109 MiB per second of audio; half that in fp8 (e4m3, the
values saturated at +-448 as they are written: `engines.config.to_cache`).
"""

from __future__ import annotations

import threading

import torch

from engines.api import EngineError
from engines.config import ConfigError
from engines.protocol import errors


class DecoderCacheFull(EngineError):
    """No free page for a chunk (or a voice's prompt): the answer that asked cannot go on (others are not affected)."""

    code = errors.SERVER_BUSY


class EstimatorPages:
    """A fixed pool of pages on one device, allocated once; `pool[step, block, kv, branch, page, frame, width]` (a
    block's pages of one step in one gather: cached_estimator.py)."""

    def __init__(self, n_pages: int, steps: int, blocks: int, frames: int, width: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        if n_pages < 1:
            raise ConfigError(f"the decoder's key/value cache needs at least one page, got {n_pages}")
        self.frames, self.width = frames, width
        # [steps, blocks, 2 kv, 2 branch, pages, frames, width]
        self.pool = torch.zeros(steps, blocks, 2, 2, n_pages, frames, width, device=device, dtype=dtype)
        self._refs = [0] * n_pages
        self._free = list(range(n_pages - 1, -1, -1))
        self._lock = threading.Lock()  # voices are prepared on the engine loop, answers decoded on codec threads

    @staticmethod
    def page_bytes(steps: int, blocks: int, frames: int, width: int, dtype: torch.dtype) -> int:
        return steps * 2 * blocks * 2 * frames * width * torch.empty(0, dtype=dtype).element_size()

    @property
    def n_pages(self) -> int:
        return len(self._refs)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int]:
        """n fresh pages (refcount 1 each), or DecoderCacheFull with none taken."""
        with self._lock:
            if n > len(self._free):
                raise DecoderCacheFull(f"the decoder's key/value cache is full ({self.n_pages} pages of "
                                       f"{self.frames} frames in use)")
            got = [self._free.pop() for _ in range(n)]
            for p in got:
                self._refs[p] = 1
            return got

    def only_holder(self, pages: list[int]) -> bool:
        """Whether one holder alone holds these pages (a cached voice no answer speaks in)."""
        with self._lock:
            return all(self._refs[p] == 1 for p in pages)

    def share(self, pages: list[int]) -> None:
        """One more holder of each page (an answer reading its voice's prompt pages)."""
        with self._lock:
            for p in pages:
                if self._refs[p] <= 0:
                    raise RuntimeError(f"page {p} is not allocated")
                self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """One holder fewer of each page; a page nobody holds goes back to the pool."""
        with self._lock:
            for p in pages:
                if self._refs[p] <= 0:
                    raise RuntimeError(f"page {p} released more often than held")
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)

    def check(self) -> None:
        """Invariant: every page is either free (refcount 0, listed once) or held, never both."""
        with self._lock:
            free, refs = set(self._free), list(self._refs)
        if len(free) != len(self._free):
            raise AssertionError("a page is listed free twice")
        for p, r in enumerate(refs):
            if (r == 0) != (p in free):
                raise AssertionError(f"page {p}: refcount {r} but {'free' if p in free else 'not free'}")
