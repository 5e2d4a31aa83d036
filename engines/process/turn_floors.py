"""Which of the encoder worker's turns to encode again with the whole-segment log-mel floor (segment_floor.py), and
when: the turn's codes as Whisper's floor (max - 8 over each whole 30 s segment) makes them.

- A call of held audio that takes a turn past a segment's end: that segment, with its now final max.
- While the user speaks, the segment under way whenever its max rose since its floor was last set (`rose`, read
  after each call of held audio): its stream is rewound to the segment's start with the max so far as its peak and
  goes on from there (a call of its own, after any commit: `RefloorJob.stream`). A commit then finds nothing to redo
  unless the max rose in its last call's audio.
- A commit (tentative too): every segment not yet redone whose floor still differs, in the commit's call. After a
  tentative commit the rewinds wait (its answer may be under way) until that answer is withdrawn (`resume`).
The turns of a call go in one batched re-encode: turns committed together in one call of a busy server would
otherwise wait for a re-encode each.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from engines.speech_in.segment_floor import Refloor, RefloorJob
from engines.speech_in.slot_pool import PoolFullError

log = logging.getLogger("engines.process")


class FloorTurn(Protocol):
    """What of the encoder worker's turn (encoder_worker._Turn) the floor's bookkeeping reads and writes."""

    stream: Any
    audio: list[np.ndarray]
    floored: int  # its 30 s segments already encoded again, as the turn passed their end
    rewound: tuple[int, float] | None  # (segment, peak) its stream was last rewound to (RefloorJob.rewound)
    peak_seen: float  # its stream's running max when its floor was last set or checked
    rising: bool  # that max rose since: a rewind is due


def turn_pcm(t: FloorTurn) -> np.ndarray:
    """The turn's audio encoded so far, as one array (kept so)."""
    pcm = t.audio[0] if len(t.audio) == 1 else np.concatenate(t.audio)
    t.audio = [pcm]
    return pcm


def job_for(encoder: Any, t: FloorTurn, final: bool, whole: bool) -> RefloorJob | None:
    """The re-encode of turn `t` after a call; None when none is due now. `whole`: every segment not yet redone, up
    to its audio so far (a commit, `final` when its stream is finalized; else a tentative commit or a rewind, whose
    open stream is rewound if its last segment is redone); else the segments it has just passed the end of."""
    if not t.audio or t.stream is None:
        return None
    if whole:
        return RefloorJob(turn_pcm(t), final, t.floored, None, t.rewound, None if final else t.stream)
    end = encoder.segments_done(t.stream.samples_seen)
    if end <= t.floored:
        return None
    return RefloorJob(turn_pcm(t), False, t.floored, end, t.rewound)


def rose(encoder: Any, turns: list[FloorTurn]) -> None:
    """After a call of held audio: mark the turns whose stream's running max rose since their floor was last set
    (one read of the encoder's peaks; an encoder without them has no rewinds)."""
    peaks = getattr(encoder, "stream_peaks", None)
    live = [t for t in turns if t.stream is not None and not getattr(t.stream, "closed", False)]
    if peaks is None or not live:
        return
    for t, p in zip(live, peaks([t.stream for t in live]).tolist(), strict=True):
        if p > t.peak_seen:
            t.rising, t.peak_seen = True, p


def after(t: FloorTurn, job: RefloorJob, r: Refloor | None) -> None:
    """Turn `t`'s bookkeeping once `job` ran and gave `r` (None: its codes there stand; a job with a stream that gave
    codes rewound it)."""
    if job.end_segment is not None:
        t.floored = job.end_segment
    if job.stream is not None and r is not None:
        t.rewound = job.stream.floor_from


def run_group(many: Any, jobs: list[RefloorJob], urgent: bool) -> list[Refloor | None | PoolFullError]:
    """The re-encode of these turns in one call, or, when the slots free for re-encodes cannot hold them all at
    once (PoolFullError: every other slot is a speaking user's, and a turn answered early keeps its own), one
    turn after another; a turn that finds no slot even alone keeps the running floor's codes (its PoolFullError in
    its place, logged). A PoolFullError comes before any stream is rewound."""
    if len(jobs) > 1:
        try:
            return many(jobs, urgent=urgent)
        except PoolFullError:
            pass  # one after another, below
    out: list[Refloor | None | PoolFullError] = []
    for job in jobs:
        try:
            out += many([job], urgent=urgent)
        except PoolFullError as e:
            log.warning("speech encoder: a turn keeps the running floor's codes: no slot to re-encode it (%s)", e)
            out.append(e)
    return out
