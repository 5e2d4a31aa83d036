"""What the full-context flow costs on a GPU, beside the windowed one: `python3 -m engines.profiling.full_context_cost`.

For each decoder context and batch size, `B` answers in one voice are decoded as the codec worker's rounds decode them
(engines/bench/codec_rounds.py), one 5-code chunk each per round, for `--seconds` of audio; prints the round times
at points of the answers (a round must stay under 400 ms, the audio it makes, for answers to play at real time), the
estimator's cache per second of audio, the device memory the rounds took, and the seconds the decoder's loading and
its graphs' capture took (a server's start waits for both); `--profile` and `--phases` take a round apart (under
torch.profiler; unprofiled, by phase); `--ahead` also times the rounds with each one queued before the one before it
is collected. A development tool, not the server.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engines.bench.codec_rounds import SteadyRounds
from engines.process.options import int_at_least
from engines.profiling.codec_timeline import Timeline
from engines.profiling.profile_loop import gpu_busy
from engines.speech_out import CodecDecoder, Voice
from engines.speech_out.presets import served_options
from engines.speech_out.voice import BUNDLED_VOICE_CODES


def _sync(dec: CodecDecoder):
    """What waits for the decoder's device (nothing on a CPU)."""
    return torch.cuda.synchronize if dec.device.type == "cuda" else (lambda: None)


def _timed_round(steady: SteadyRounds, sync) -> tuple[float, list[np.ndarray]]:
    """The next round's codes fed, then the round alone timed (ms, from an idle device) and its PCM per answer."""
    steady.feed()
    sync()
    t0 = time.perf_counter()
    pcm = steady.decode()
    sync()
    return (time.perf_counter() - t0) * 1e3, pcm


def _check_finite(pcm: list[np.ndarray]) -> None:
    if any(not np.isfinite(p).all() for p in pcm):
        raise RuntimeError("non-finite PCM")


def _rounds(dec: CodecDecoder, batch: int, rounds: int, voice: Voice) -> list[float]:
    """Each round's ms (a round without a ready chunk, an answer's start in a voice whose prompt tail waits for more
    codes, is timed too)."""
    steady = SteadyRounds(dec, batch, voices=[voice])
    sync = _sync(dec)
    ms = []
    try:
        for _ in range(rounds):
            t, pcm = _timed_round(steady, sync)
            ms.append(t)
            _check_finite(pcm)
    finally:
        steady.close()
    return ms


def _rounds_ahead(dec: CodecDecoder, batch: int, rounds: int, voice: Voice) -> list[float]:
    """Each round's ms with the next one queued before it is collected (`QueuedRound`), as a codec worker that keeps
    one round queued ahead would run them: from one round's PCM on the host to the next's. The host prepares a round
    while the device still runs the one before it."""
    steady = SteadyRounds(dec, batch, voices=[voice])
    ms = []
    try:
        steady.feed()
        pending = steady.queue()
        t = time.perf_counter()
        for _ in range(rounds):
            steady.feed()
            ahead = steady.queue()
            pcm = steady.collect(pending)
            now = time.perf_counter()
            _check_finite(pcm)
            ms.append((now - t) * 1e3)
            t, pending = now, ahead
        steady.collect(pending)
    finally:
        steady.close()
    return ms


def _at(ms: list[float], seconds: float) -> dict[str, float]:
    """Median round ms around 0.4 / 2 / 10 / 20 s and `seconds` into the answers (2.5 rounds a second)."""
    return {f"{t:g}s": round(float(np.median(ms[max(0, int(t * 2.5) - 1):int(t * 2.5) + 2])), 1)
            for t in sorted({0.4, 2, 10, 20, seconds}) if t * 2.5 <= len(ms)}


def _first_job(dec: CodecDecoder, batch: int, voice: Voice, repeats: int = 5) -> float:
    """Median ms of the round that decodes `batch` answers' first jobs together (the prompt's tail and their first
    codes: what an answer's first audio waits for), over `repeats` starts."""
    sync = _sync(dec)
    ms = []
    for _ in range(repeats):
        steady = SteadyRounds(dec, batch, voices=[voice])
        try:
            for _ in range(10):  # a first job waits for at most 3 chunks of codes
                t, pcm = _timed_round(steady, sync)
                if any(p.size for p in pcm):
                    ms.append(t)
                    break
        finally:
            steady.close()
    return float(np.median(ms))


def _profile(dec: CodecDecoder, batch: int, rounds: int, voice: Voice, top: int = 25) -> None:
    """The CUDA ops of the last of `rounds` rounds of `batch` answers (torch.profiler), most time first; then the
    operators by input shapes (which call launches a kernel named only by its template)."""
    steady = SteadyRounds(dec, batch, voices=[voice])
    try:
        for _ in range(rounds - 1):
            steady.feed()
            steady.decode()
        steady.feed()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
            steady.decode()
            torch.cuda.synchronize()
        busy, span, gaps = gpu_busy(prof)
        print(f"profile: batch {batch}, round {rounds}: GPU busy {busy:.1f} ms over a span of {span:.1f} ms, {gaps} "
              "gaps over 20 us (under the profiler)", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top), flush=True)
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=top,
                                                                  max_name_column_width=40), flush=True)
    finally:
        steady.close()


# What `--phases` times in a round: (owner on the decoder, method, label).
PHASES = (("full", "_encode_groups", "encoder"), ("full", "_solve", "solve"), ("windowed", "render", "vocoder"))


def _phases(dec: CodecDecoder, batch: int, rounds: int, voice: Voice, last: int = 10) -> dict[str, float]:
    """Medians over the last `last` of `rounds` rounds, unprofiled (ms): the round, the host's wait for the GPU at its
    end, and per phase the host's time in it and (CUDA) the GPU's timeline between events around it: a phase whose
    timeline is as long as its host time kept the GPU waiting for its launches. On CUDA also the timeline from the
    round's start to its first phase (`gpu_before_phases`: the host preparing the round while the device, idle
    between timed rounds, waits) and from its last phase to the round's end (`gpu_after_phases`)."""
    tl = Timeline(dec.device.type == "cuda")
    for owner, method, label in PHASES:
        tl.around(getattr(dec, owner), method, label, gpu=True)
    steady = SteadyRounds(dec, batch, voices=[voice])
    outer = Timeline(tl.cuda)
    outer.around(steady, "decode", "round", gpu=True)
    rows = []
    try:
        for _ in range(rounds):
            tl.marks.clear()
            outer.marks.clear()
            dec.last_gpu_wait_s = 0.0
            ms, _pcm = _timed_round(steady, _sync(dec))
            row = {"round": ms, "host_wait": dec.last_gpu_wait_s * 1e3}
            # a phase's calls are not nested: each "label>" mark is followed by its "label<"
            for (name, h0, e0), (_, h1, e1) in zip(tl.marks[::2], tl.marks[1::2], strict=True):
                label = name[:-1]
                row[f"host_{label}"] = row.get(f"host_{label}", 0.0) + (h1 - h0) * 1e3
                if e0 is not None:
                    row[f"gpu_{label}"] = row.get(f"gpu_{label}", 0.0) + e0.elapsed_time(e1)
            (_, _, r0), (_, _, r1) = outer.marks
            if r0 is not None and tl.marks:
                row["gpu_before_phases"] = r0.elapsed_time(tl.marks[0][2])
                row["gpu_after_phases"] = tl.marks[-1][2].elapsed_time(r1)
            rows.append(row)
    finally:
        steady.close()
        outer.restore()
        tl.restore()
    tail = rows[-last:]
    return {k: round(float(np.median([r.get(k, 0.0) for r in tail])), 2) for k in tail[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codec", default="full-random")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int_at_least(1), nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=20.0, help="audio per answer")
    p.add_argument("--prompt-codes", type=int_at_least(0), default=BUNDLED_VOICE_CODES,
                   help=f"the voice prompt's codes ({BUNDLED_VOICE_CODES}: the bundled voice)")
    p.add_argument("--contexts", nargs="+", default=["window", "full"])
    p.add_argument("--cache-gib", type=float, default=None, help="the full-context decoder's key/value cache "
                   "(default: as served, 40 GiB or 45%% of the GPU's free memory); answers that outgrow it forget "
                   "their oldest chunks")
    p.add_argument("--cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the full-context decoder's key/value element type (--decoder-cache-dtype)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile", action="store_true", help="also print the CUDA ops of the last round at the largest "
                   "batch (torch.profiler)")
    p.add_argument("--ahead", action="store_true", help="also time rounds back to back with the next one queued "
                   "before each is collected (the host preparing a round while the device runs the last)")
    p.add_argument("--phases", action="store_true", help="also time the phases of the rounds at the largest batch, "
                   "unprofiled: host and GPU time of the flow's encoder, its solve and the vocoder")
    a = p.parse_args(argv)
    voice = Voice.random(seed=3, n_codes=a.prompt_codes)
    n_rounds = int(a.seconds * 12.5 / 5) + 1
    results = []
    for context in a.contexts:
        cuda = a.device.startswith("cuda")
        t0 = time.perf_counter()
        dec = CodecDecoder.load(a.codec, device=a.device, context=context,
                                cache_gib=a.cache_gib if context == "full" else None, cache_dtype=a.cache_dtype,
                                **served_options(a.codec, cuda, vocoder="hift"))
        t1 = time.perf_counter()
        dec.capture_graphs(max(a.batches))
        row = {"context": context, "load_s": round(t1 - t0, 1), "capture_graphs_s": round(time.perf_counter() - t1, 1)}
        print(json.dumps(row), flush=True)
        results.append(row)
        for batch in a.batches:
            _rounds(dec, batch, 3, voice)  # warm: first uses, allocator
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if cuda else 0
            ms = _rounds(dec, batch, n_rounds, voice)
            peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")
            row = {"context": context, "cache_dtype": a.cache_dtype, "batch": batch, "round_ms_at": _at(ms, a.seconds),
                   "first_job_ms": round(_first_job(dec, batch, voice), 1), "peak_extra_gib": round(peak, 2)}
            if a.ahead:
                row["round_ms_queued_ahead_at"] = _at(_rounds_ahead(dec, batch, n_rounds, voice), a.seconds)
            print(json.dumps(row), flush=True)
            results.append(row)
        if a.profile and cuda:
            _profile(dec, max(a.batches), n_rounds, voice)
        if a.phases and context == "full":
            row = {"context": context, "batch": max(a.batches), "phases_ms": _phases(dec, max(a.batches), n_rounds,
                                                                                    voice)}
            print(json.dumps(row), flush=True)
            results.append(row)
        if dec.full is not None:
            pages = dec.full.pages
            page = pages.pool.numel() // pages.n_pages * pages.pool.element_size()
            row = {"context": context, "page_mib": round(page / 2**20, 1),
                   "mib_per_audio_s": round(page * 2.5 / 2**20, 1), "pages": pages.n_pages,
                   "pages_forgotten": dec.full.forgotten}
            print(json.dumps(row), flush=True)
            results.append(row)
        del dec
        if cuda:
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
