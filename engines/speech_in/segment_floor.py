"""A committed turn's codes with Whisper's log-mel floor: (max - 8) over each whole <= 30 s segment.

While the user speaks, the frontend floors each frame at (running max - 8) (log_mel.py): a frame before the turn's
loudest one is floored lower than the reference floors it. Once the turn's audio is whole (a commit), each segment's
max is known: the turn is encoded again from the first segment whose floor changes, by streams that start there
with that segment's max as their peak (MelState.peak) and the samples before it as their frame buffer, so their
frames, trunk and codes are those of the served stream but for the floor. Codes before the first frame whose floor
changes are the same in both (the trunk is causal): the result starts at the code of that frame.

The segments from the first changed one go in one batched encoder call (one stream each; with `refloor_many`, those
of every turn committed at once go in one call); the frame maxima of all those turns are one log-mel pass on the
encoder's device, on the call's stream, with one copy to the host. A segment's max is final once its last frame is
in: the service re-encodes each segment as the turn passes its end (on the encoder's lowest-priority stream, while
the user still speaks), so that a commit re-encodes at most the turn's last segment or two.

While the user speaks, the segment under way can be redone with its max so far by rewinding the turn's own stream
(`RefloorJob.stream`): it is encoded again from the segment's start with that max as its peak, and goes on from
there, so that a commit finds nothing to redo unless the max rose after. The rewound stream's floor is then
max(that peak, the running max from the segment's start) (`RefloorJob.rewound`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engines.speech_in.log_mel import FFT_ROWS

if TYPE_CHECKING:
    from engines.speech_in.encoder import EncoderStream, SpeechEncoder


@dataclass(frozen=True)
class Refloor:
    """A turn's codes with the whole-segment floor, from `first` on (codes before it stand)."""

    first: int
    codes: list[int]  # those of [first, first + len(codes)); later ones stand too
    frames: int  # mel frames encoded again (the call's size)
    total: int  # the turn's codes so far (the stream's)

    def apply(self, codes: list[int]) -> list[int]:
        """The turn's codes `codes` (as streamed) with these in their place."""
        return codes[: self.first] + self.codes + codes[self.first + len(self.codes):]


def frame_peaks(encoder: SpeechEncoder, xs: list[np.ndarray]) -> list[np.ndarray]:
    """[frames] each complete frame's log-mel max (before the floor) of a stream fed x, for each x of `xs`, as its
    frontend frames it (zeros before the stream): the frames of all of them in one pass, a segment's rows at a time,
    with the frontend's own kernels, and one copy to the host."""
    cfg, fe = encoder.cfg, encoder.frontend
    half, hop, seg = cfg.n_fft // 2, cfg.hop_length, cfg.mel_per_segment
    counts = [0 if x.size + half < cfg.n_fft else (x.size + half - cfg.n_fft) // hop + 1 for x in xs]
    padded = [np.concatenate([np.zeros(half, np.float32), x]) for x in xs]
    offsets = np.cumsum([0] + [p.size for p in padded[:-1]])
    starts = np.concatenate([o + hop * np.arange(n, dtype=np.int64) for o, n in zip(offsets, counts, strict=True)]
                            + [np.zeros(0, np.int64)])  # [frames of all] each frame's first sample
    if not starts.size:
        return [np.zeros(0, np.float32) for _ in xs]
    samples = torch.from_numpy(np.concatenate(padded)).to(encoder.device)
    out = []
    for a in range(0, starts.size, seg):
        m = min(seg, starts.size - a)
        # Rows padded as the served steps pad them (log_mel.FFT_ROWS): cuFFT makes a plan per batch size.
        first = np.concatenate([starts[a:a + m], np.full(-m % FFT_ROWS, starts[a + m - 1])])
        out.append(fe.raw_log_mel(samples, torch.from_numpy(first).to(encoder.device))[:m].amax(dim=1))
    return np.split(torch.cat(out).cpu().numpy(), np.cumsum(counts)[:-1])


def segments_done(encoder: SpeechEncoder, n_samples: int) -> int:
    """The 30 s segments whose every frame a stream fed n samples has: their max, so their floor, is final."""
    cfg = encoder.cfg
    seg_samples = cfg.mel_per_segment * cfg.hop_length
    return max(0, n_samples - (cfg.n_fft // 2 - cfg.hop_length)) // seg_samples


@dataclass(frozen=True)
class RefloorJob:
    """One turn for `refloor_many`: its samples so far and which of its segments to redo (see `refloor`).
    `rewound`: (segment, peak) of the turn's stream's last rewind, if any: its frames from that segment's start on
    were floored at max(peak, the running max from there). `stream`: the turn's open stream (not `final`, every
    segment up to the last asked for): the last segment, if redone, is redone by rewinding it, and it goes on with
    that segment's max as its floor."""

    pcm: np.ndarray
    final: bool
    first_segment: int = 0
    end_segment: int | None = None
    rewound: tuple[int, float] | None = None
    stream: EncoderStream | None = None

    def __post_init__(self) -> None:
        if self.stream is not None and (self.final or self.end_segment is not None):
            raise ValueError("only a turn's open stream, redone up to its last segment, can be rewound")


@dataclass(frozen=True)
class _Plan:
    x: np.ndarray  # the stream's samples (a final turn's tail padded)
    total: int  # the turn's codes so far
    seg_max: list[float]
    first_frame: int  # the first frame whose floor changes
    end: int  # segments [first_frame's, end) are encoded again
    frames: int  # mel frames so far


def _stream_samples(encoder: SpeechEncoder, job: RefloorJob) -> np.ndarray:
    """What the turn's stream is fed: a final turn's tail padded as `finalize` pads it."""
    pcm = job.pcm
    return np.concatenate([pcm, np.zeros(encoder.tail_padding(pcm.size), np.float32)]) if job.final else pcm


def _plan(encoder: SpeechEncoder, job: RefloorJob, x: np.ndarray, peaks: np.ndarray) -> _Plan | None:
    cfg = encoder.cfg
    pcm = job.pcm
    seg = cfg.mel_per_segment
    seg_max = [float(peaks[a:a + seg].max()) for a in range(0, peaks.size, seg)]
    end = len(seg_max) if job.end_segment is None else min(job.end_segment, len(seg_max))
    lo = job.first_segment
    if lo >= end:
        return None
    running = np.maximum.accumulate(peaks)
    if job.rewound is not None:
        at, peak = job.rewound[0] * seg, job.rewound[1]
        running[at:] = np.maximum(np.maximum.accumulate(peaks[at:]), peak)
    floors = np.repeat(np.asarray(seg_max, np.float32), seg)[: peaks.size]
    changed = np.flatnonzero(running[lo * seg:end * seg] != floors[lo * seg:end * seg])
    if not changed.size:
        return None
    total = (encoder.codes_for_samples(pcm.size) if job.final
             else max(0, (pcm.size - cfg.code_lag_samples) // cfg.samples_per_code + 1))
    return _Plan(x, total, seg_max, int(changed[0]) + lo * seg, end, int(peaks.size))


def refloor_many(encoder: SpeechEncoder, jobs: list[RefloorJob], urgent: bool = True) -> list[Refloor | None]:
    """`refloor` of several turns, their segments to redo all in one batched encoder call."""
    cfg = encoder.cfg
    for job in jobs:
        if job.stream is not None and job.stream.samples_seen != job.pcm.size:
            raise ValueError(f"a stream to rewind has had {job.stream.samples_seen} samples, its turn {job.pcm.size}")
    xs = [_stream_samples(encoder, job) for job in jobs]
    plans = [_plan(encoder, job, x, peaks) for job, x, peaks in zip(jobs, xs, frame_peaks(encoder, xs), strict=True)]
    half, seg = cfg.n_fft // 2, cfg.mel_per_segment
    seg_samples = seg * cfg.hop_length
    per_seg = cfg.codes_per_segment
    streams, pieces, owner, opened, rewinds = [], [], [], [], []
    try:
        for i, (job, plan) in enumerate(zip(jobs, plans, strict=True)):
            if plan is None:
                continue
            for j in range(plan.first_frame // seg, plan.end):
                start = j * seg_samples
                if job.stream is not None and j == plan.end - 1:
                    s = job.stream
                    rewinds.append((s, j, plan))
                    piece = plan.x[start:]  # all it has had: it goes on from there
                else:
                    s = encoder.open_stream(reencode=True)
                    opened.append(s)
                    _start_at(encoder, s, plan, j)
                    piece = plan.x[start:start + seg_samples + half]  # (its last frame ends half a window past)
                streams.append(s)
                owner.append(i)
                pieces.append(piece)
        for s, j, plan in rewinds:  # (after every slot is had: a PoolFullError leaves the turns' streams as they were)
            _start_at(encoder, s, plan, j)
        out = encoder.batch(urgent).step(list(zip(streams, pieces, strict=True))) if streams else []
    finally:
        for s in opened:
            s.close()
    rewound = {id(s) for s, *_ in rewinds}
    codes: dict[int, list[int]] = {}
    for i, s, part in zip(owner, streams, out, strict=True):
        # (a segment's stream may go a frame into the next one; a rewound stream's codes are all the turn's from there)
        codes.setdefault(i, []).extend(part if id(s) in rewound else part[:per_seg])
    results: list[Refloor | None] = []
    for i, plan in enumerate(plans):
        if plan is None:
            results.append(None)
            continue
        j0 = plan.first_frame // seg
        first = plan.first_frame // cfg.mel_per_code
        results.append(Refloor(first, codes[i][first - j0 * per_seg:], min(plan.frames, plan.end * seg) - j0 * seg,
                               plan.total))
    return results


def _start_at(encoder: SpeechEncoder, s: EncoderStream, plan: _Plan, j: int) -> None:
    """Make stream `s` (a new one, or a turn's own, rewound) start at segment j with that segment's max as its peak:
    it is then fed the turn's samples from the segment's start."""
    cfg = encoder.cfg
    half, start = cfg.n_fft // 2, j * cfg.mel_per_segment * cfg.hop_length
    before = plan.x[max(0, start - half):start]  # the samples of the segment's first frames before it (zeros first)
    s.mel.buf = np.concatenate([np.zeros(half - before.size, np.float32), before])
    s.mel.frames_done, s.mel.samples_seen, s.mel.peak = 0, start, plan.seg_max[j]
    s.codes_out = j * cfg.codes_per_segment
    s.floor_from = (j, plan.seg_max[j])
    encoder.runner.reset_segment(s.trunk)


def refloor(encoder: SpeechEncoder, pcm: np.ndarray, final: bool, first_segment: int = 0,
            end_segment: int | None = None, urgent: bool = True) -> Refloor | None:
    """The turn `pcm` (all its samples so far) encoded with each segment's own floor, its segments from
    `first_segment` up to `end_segment` (None: all), as the stream is (`final`: finalized, its tail padded as
    `finalize` pads it; else only its codes determined so far); None when every frame's floor there is already the
    segment's. `urgent`: on the encoder's urgent stream (a commit's), else on its lowest-priority one."""
    return refloor_many(encoder, [RefloorJob(pcm, final, first_segment, end_segment)], urgent)[0]
