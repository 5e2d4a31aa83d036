"""What a worker process knows of its siblings: its index, their private sockets (where it relays the calls they
hold: server/transports/relay.py), the shared counts."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from server.transports.relay import Owner

_CALL_ID = re.compile(r"rtc_w(\d{1,4})_[0-9a-f]+", re.ASCII)


@dataclass(frozen=True)
class WorkerContext:
    index: int
    count: int
    socket_dir: str  # worker i serves its private unix socket at socket_dir/worker-i.sock
    session_counts: Any  # shared array of `count` ints: each worker's open sessions (server/workers/slots.py)
    engine_generation: Any = None  # multiprocessing Value("i"): engines lost so far; None: engine run elsewhere

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"worker index {self.index} is outside 0..{self.count - 1}")

    @property
    def slots_lock_path(self) -> str:
        return os.path.join(self.socket_dir, "slots.lock")

    def socket_path(self, index: int) -> str:
        return os.path.join(self.socket_dir, f"worker-{index}.sock")

    @property
    def call_id_prefix(self) -> str:
        return f"rtc_w{self.index}_"

    def owner_of(self, call_id: str) -> int | None:
        """The index of the worker that holds `call_id`, or None for an id no worker of ours made."""
        match = _CALL_ID.fullmatch(call_id)
        if match is None:
            return None
        index = int(match.group(1))
        return index if index < self.count else None

    async def owner(self, call_id: str) -> Owner | None:
        """The sibling worker holding `call_id` (server.transports.relay.Siblings); None when it is ours or no
        worker's."""
        index = self.owner_of(call_id)
        if index is None or index == self.index:
            return None
        return Owner(f"worker {index}", uds=self.socket_path(index))

    def engine_generation_now(self) -> int:
        return int(self.engine_generation.value)
