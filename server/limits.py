"""The server's session limit when none is set (MOSS_MAX_SESSIONS), and whether its server processes carry it.

On a GPU the limit is what the engine can hold, read from the stats it reports once ready: no more sessions than
SESSIONS_PER_RUNNING times the sequences it runs at once (--max-running), nor than its KV pool holds conversations of
SESSION_ROWS rows (fewer when --max-model-len is shorter); with the full-context speech decoder, no more than it keeps
in real time (FULL_CONTEXT_SESSIONS) nor than its cache holds answers of the chunks each keeps (its stats'
decoder_pages_kept). Off a GPU, or when the engine does not report those figures, it is CPU_MAX_SESSIONS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

CPU_MAX_SESSIONS = 64
# Rows of KV a session is counted as holding: a modest conversation of ~2.7 minutes at 12.5 rows a second (user
# speech and answers alike), about twenty exchanges of a spoken turn and its answer (~80-130 rows each).
SESSION_ROWS = 2048
# A session holds a running sequence only while its turn is prefilled or its answer decoded, not while the user
# listens or speaks: 256 sessions passed the capacity criteria at --max-running 128 on an H200 (2026-12-01, with the
# windowed decoder; docs/performance.md, Capacity).
SESSIONS_PER_RUNNING = 2
# Sessions one engine with the full-context speech decoder (the default; it reports its cache's pages) keeps in real
# time: its decoding rounds bind before the language model does. On an H200, 40 sessions played with no underrun in
# five runs, 56 with none in one and 25 underrun turns of 112 in another; 32 users churning for 4 minutes had none;
# p95 TTFA 193 ms at 24, 257 at 32 (2026-12-04, docs/performance.md, Capacity and Soak).
FULL_CONTEXT_SESSIONS = 32
# With that decoder, a session is counted as holding the pages of an answer in progress that its cache always keeps
# (decoder_pages_kept: 28 chunks, ~11.2 s): the default cache on a card with room for 40 GiB (936 pages) holds more
# than FULL_CONTEXT_SESSIONS such sessions; a smaller one (an 80 GB card's default, --decoder-cache-gib) holds fewer.
# Past that, a long answer forgets its oldest chunks when the cache runs short, and an answer that cannot keep even
# those stops with server_busy.
_REPORTED = ("device", "max_running", "max_model_len", "kv_total", "kv_block_rows")

# Real-time WebSocket sessions one server process's event loop carries (decoding appends, resampling, VAD, outbound
# events). On a 16-core H200 host one process fell behind real time at 140 sessions: the VAD's commits came 0.9 s
# (p95) after speech end, 2.6 s at 172 (docs/operations.md, "Workers").
SESSIONS_PER_WORKER = 100


@dataclass(frozen=True)
class SessionLimit:
    sessions: int
    why: str


def session_limit(stats: dict[str, Any]) -> SessionLimit:
    """The session limit the engine's stats (its Pong) allow."""
    if not all(isinstance(stats.get(k), int | str) for k in _REPORTED):
        return SessionLimit(CPU_MAX_SESSIONS, "the engine does not report its capacity")
    if not str(stats["device"]).startswith("cuda"):
        return SessionLimit(CPU_MAX_SESSIONS, f"the engine runs on {stats['device']}")
    rows = int(stats["kv_total"]) * int(stats["kv_block_rows"])
    per_session = min(SESSION_ROWS, int(stats["max_model_len"]))
    by_pool = max(rows // per_session, 1)
    running = int(stats["max_running"])
    by_running = SESSIONS_PER_RUNNING * running
    why = (f"the engine runs {running} sequences at once ({by_running} sessions at {SESSIONS_PER_RUNNING} a sequence) "
           f"and its KV pool of {rows} rows holds {by_pool} conversations of {per_session} rows")
    limit = SessionLimit(min(by_running, by_pool), why)
    if "decoder_pages_total" not in stats:
        return limit
    pages, kept = int(stats["decoder_pages_total"]), int(stats["decoder_pages_kept"])
    by_cache = max(pages // kept, 1)
    if by_cache < FULL_CONTEXT_SESSIONS:
        cap, reason = by_cache, (f"its full-context speech decoder's cache of {pages} pages holds {by_cache} sessions' "
                                 f"answers of {kept} chunks (--decoder-cache-gib sets it)")
    else:
        cap = FULL_CONTEXT_SESSIONS
        reason = f"its full-context speech decoder keeps about {FULL_CONTEXT_SESSIONS} in real time"
    return SessionLimit(cap, f"{limit.why}, but {reason}") if limit.sessions > cap else limit


def size_from_engine(stats: dict[str, Any], workers: int, log: logging.Logger) -> int:
    """session_limit's figure, logged with why (and workers_advice's warning where it has one)."""
    limit = session_limit(stats)
    log.info("max_sessions %d: %s (MOSS_MAX_SESSIONS sets it)", limit.sessions, limit.why)
    if (advice := workers_advice(limit.sessions, workers)) is not None:
        log.warning("%s", advice)
    return limit.sessions


def size_from_engines(stats: list[dict[str, Any]], workers: int, log: logging.Logger) -> int:
    """The session limit of several engines (--gpus, Ray's replicas): the sum of each one's, logged once. One engine:
    size_from_engine's."""
    if len(stats) == 1:
        return size_from_engine(stats[0], workers, log)
    each = [session_limit(s).sessions for s in stats]
    total = sum(each)
    log.info("max_sessions %d: the sum of %d engines' (%s; MOSS_MAX_SESSIONS sets it)", total, len(each),
             " + ".join(map(str, each)))
    if total > SESSIONS_PER_WORKER:
        log.warning("max_sessions %d in one server process: it carries ~%d real-time sessions, beyond that turns end "
                    "late and audio stutters; past that run on Ray Serve with more front ends (docs/operations.md, "
                    "Scaling out)", total, SESSIONS_PER_WORKER)
    return total


def workers_advice(max_sessions: int, workers: int) -> str | None:
    """A warning when the session limit is more than the server processes carry in real time, else None."""
    need = -(-max_sessions // SESSIONS_PER_WORKER)
    if workers >= need:
        return None
    return (f"max_sessions {max_sessions} with {workers} server process(es): one process carries "
            f"~{SESSIONS_PER_WORKER} real-time sessions, beyond that turns end late and audio stutters; "
            f"use --workers {need} (MOSS_WORKERS) or more, cores allowing")
