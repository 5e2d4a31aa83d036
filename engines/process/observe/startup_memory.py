"""What holds the GPU's memory at start-up, so that running out of it while loading says which part took how much
and which options shrink them, instead of a traceback from deep inside a CUDA graph capture; and each part's time,
logged (a full-size engine starts in minutes: the log says where they go).

Why: the parts sized by options add up past an 80 GB card easily. With `--max-running 128` the speech encoder
reserves float32 KV slots for 128 streams (~31 GiB at full size) next to the model (~17 GiB) and its KV pool
(`--kv-cache-gib`) and the speech decoder's cache (`--decoder-cache-gib`: 40 GiB, or 45% of the memory free
as it loads where that is less); on an H100 with `--kv-cache-gib 24` the codec's graph capture ran out of memory last.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch

from engines.config import ConfigError
from engines.cuda.memory import free_bytes
from engines.lm.kv.sizing import GIB

log = logging.getLogger("engines.process")

ADVICE = ("lower --kv-cache-gib (the language model's KV pool), --decoder-cache-gib (the speech decoder's cache of "
          "earlier chunks, by default 40 GiB or 45% of the GPU's free memory; --decoder-cache-dtype fp8 holds the same "
          "audio in half) or --max-running (sequences decoded together; also the speech encoder's KV slots and "
          "the codec's largest batch)")


class StartupMemory:
    """Measures each loading step's GPU memory (`part`); an out-of-memory error inside one becomes a ConfigError that
    names it, the parts loaded before it with their sizes, the device's capacity and ADVICE.
    A part's size is what the device holds more after it (`used`: capacity less the driver's free memory), not what
    torch counts allocated: CUDA graphs keep memory in private pools that no tensor holds (the codec's graphs for
    batches of up to 64 on an H100: 9.1 GiB held; captured smallest first, 2.2 GiB allocated and ~12.7 held)."""

    def __init__(self, device: str, used: Callable[[], int] | None = None,
                 capacity: Callable[[], int] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        on_gpu = device.startswith("cuda") and torch.cuda.is_available()
        self.device = device
        self._capacity = capacity or ((lambda: torch.cuda.get_device_properties(device).total_memory) if on_gpu
                                      else (lambda: 0))
        self._used = used or ((lambda: self._capacity() - free_bytes(device)) if on_gpu else (lambda: 0))
        self.parts: list[tuple[str, int]] = []  # (what, bytes the device holds more after it)
        self._clock = clock

    @contextlib.contextmanager
    def part(self, what: str) -> Iterator[None]:
        before, t0 = self._used(), self._clock()
        try:
            yield
        except torch.OutOfMemoryError as e:
            raise ConfigError(self.message(what, e)) from None
        self.parts.append((what, self._used() - before))
        log.info("start-up: %s in %.1f s (%.2f GiB)", what, self._clock() - t0, self.parts[-1][1] / GIB)

    def message(self, what: str, error: BaseException) -> str:
        loaded = ", ".join(f"{name} {size / GIB:.1f} GiB" for name, size in self.parts) or "nothing yet"
        cap = self._capacity()
        on = f"{self.device} ({cap / GIB:.1f} GiB)" if cap else self.device
        tried = ". ".join(str(error).split(". ")[:2])  # "CUDA out of memory. Tried to allocate N MiB"
        return f"out of GPU memory on {on} while loading {what} ({tried}); loaded before: {loaded}; {ADVICE}"
