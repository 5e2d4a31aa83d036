"""Where a codec chunk's time goes: `python3 -m engines.profiling.profile_codec --codec full-random` on a GPU.

Of the windowed flow (`--decoder-context window`). Splits one steady-state 5-code chunk, decoded in a round as the
server's codec worker decodes it
(engines/bench/codec_rounds.py), into its stages (flow encoder, Euler solve, vocoder) with the device
synchronised around each, counts the kernels of one eager estimator call, and optionally times the Euler
solve with the estimator under torch.compile. `--timeline` times replays of the solve's CUDA graph as served, with
programmatic dependent launch (engines/kernels/pdl.py) off and on, the estimator's to_out / ff output GEMMs on
cuBLAS or on the kernels' `linear` (engines/kernels/speech_out/flow/gemm.py), and the streaming-size conv kernel on or
off; `--tiles` per tiling of the streaming-size kernels (StreamTiles, engines/kernels/speech_out/flow/common.py);
`--chains` per number of estimator chains side by side.
A development tool, not the server.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from engines.bench.codec_rounds import SteadyRounds
from engines.bench.hardware import median, replay_ms


def _stage_times(dec, rounds: SteadyRounds, iters: int) -> dict[str, float]:
    """Median ms per stage, measured by wrapping the stage methods with synchronised timers."""
    flow, win = dec.flow, dec.windowed
    sync = torch.cuda.synchronize if flow.device.type == "cuda" else (lambda: None)  # (CPU: the tests)
    # The encoder as a steady chunk runs it: its inputs written into the graph's buffers and the replay
    # (`_encode_in_place`), or, with no encoder graphs, the inputs built and the eager call. Never wrap what a
    # capture runs. (the vocoder's GPU work is queued by render; finish only crossfades on the host)
    wrapped = [(flow, "_solve", "solve"), (win, "render", "vocoder")]
    wrapped += ([(flow, "_encode_in_place", "encoder")] if flow.enc_graphs is not None
                else [(flow, "encode", "encoder"), (flow, "encode_inputs", "encoder_inputs")])
    acc: dict[str, list[float]] = {"total": [], **{name: [] for _, _, name in wrapped}}

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            acc[name].append((time.perf_counter() - t0) * 1e3)
            return out
        return wrapper

    for owner, attr, name in wrapped:
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    try:
        for _ in range(iters):
            rounds.feed()
            sync()
            t0 = time.perf_counter()
            pcm = rounds.decode()
            sync()
            acc["total"].append((time.perf_counter() - t0) * 1e3)
            bad = sum(int((~np.isfinite(p)).sum()) for p in pcm)
            if bad:
                print(f"  non-finite PCM: {bad} samples in a round of {len(pcm)} sessions")
    finally:
        for owner, attr, _ in wrapped:
            delattr(owner, attr)
    skip = dec.cfg.stream.steady_chunks  # rounds before it capture graphs as the encoder's window grows
    if iters <= skip:
        raise ValueError(f"--iters must exceed {skip}: the first {skip} rounds are not steady state")
    out = {k: median(v[skip:]) for k, v in acc.items() if len(v) > skip}
    out["host_and_rest"] = out["total"] - sum(v for k, v in out.items() if k != "total")
    return out


def _estimator_kernels(dec, batch: int, top: int = 0) -> tuple[int, float]:
    """Kernels launched by one eager estimator call (CFG doubles the batch) and their summed GPU time (us).
    With `top`, also prints the `top` kernel names by summed GPU time."""
    f = dec.flow
    est = f.decoder.estimator
    C, W = dec.cfg.stream.est_ctx_frames, dec.cfg.stream.est_ctx_frames + 4 * dec.cfg.stream.chunk_codes
    dt = est.final_proj.weight.dtype
    x = torch.randn(2 * batch, 80, W, device="cuda", dtype=dt)
    t = torch.full((2 * batch,), 0.3, device="cuda", dtype=dt)
    spk = torch.randn(2 * batch, 80, device="cuda", dtype=dt)
    idx = torch.arange(W, device="cuda")
    mask = (idx[None, :] < C) | (idx[:, None] >= C)
    with torch.inference_mode():
        est(x, x, t, spk, x, mask)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            est(x, x, t, spk, x, mask)
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    _print_top(evs, top)
    return len(evs), sum(e.device_time for e in evs)


def _print_top(evs, top: int) -> None:
    by: dict[str, list[float]] = {}
    for e in evs:
        by.setdefault(e.name[:90], []).append(e.device_time)
    for name, ts in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(ts):8.1f} us  {len(ts):4d} x {sum(ts) / len(ts):6.2f} us  {name}")


def _host_profile(rounds: SteadyRounds, iters: int, top: int = 25) -> None:
    """cProfile of `iters` steady-state rounds (host time per function: what a codec round costs the GIL)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(iters):
        rounds.feed()
        torch.cuda.synchronize()
        prof.enable()
        rounds.decode()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _solve_ms(flow, batch: int, reps: int) -> tuple[float, torch.Tensor]:
    """Capture the solve at `batch` on fresh graphs and time `reps` replays: ms per solve, and its mel."""
    from engines.speech_out.chunk_graphs import EulerGraphs

    graphs = EulerGraphs(flow)
    g = torch.Generator(device=flow.device).manual_seed(0)
    inputs = [torch.randn(shape, device=flow.device, dtype=flow.dtype, generator=g)
              for shape in graphs.input_shapes(batch)]
    with torch.inference_mode():
        x, _ = graphs.run(*inputs)
        return replay_ms(next(iter(graphs.graphs.values()))[0], reps), x


def _print_solve(batch: int, ms: float, x: torch.Tensor, ref: torch.Tensor | None, ref_name: str, name: str
                 ) -> torch.Tensor:
    """One line of a solve comparison: time, and the largest difference from the batch's first variant's mel (ref;
    None for the first, which becomes ref). Returns ref."""
    diff = 0.0 if ref is None else float((x.float() - ref.float()).abs().max())
    print(f"solve batch {batch:3d}: {ms:7.3f} ms, max |x - {ref_name}| {diff:.2e}  {name}", flush=True)
    return x if ref is None else ref


# (name, PDL, to_out/ff2 GEMM, whole-tile convs, block1 conv and res_conv as one conv, a stack's last residual add,
# the flat conv loop from CONV_FLAT_MIN_ROWS rows)
TIMELINE_VARIANTS = (
    ("PDL off, cuBLAS GEMMs, looped conv, resnet 5 kernels, add kernel", False, "cublas", False, False, "add", False),
    ("PDL on, Triton GEMMs, whole conv (ba0ecd3)", True, "triton", True, False, "add", False),
    ("  + block1 conv | res_conv as one conv", True, "triton", True, True, "add", False),
    ("  + last add in the GEMM epilogue", True, "triton", True, True, "epilogue", False),
    ("  + flat conv loop for playing rounds (served)", True, "triton", True, True, "epilogue", True),
)


def _timeline(dec, batches: list[int], reps: int) -> None:
    """The solve graph per variant of TIMELINE_VARIANTS, same inputs for each. (Per-kernel times of graph replays
    from torch.profiler did not add up to one replay's kernels on torch 2.11, so only replay times are reported.)"""
    from engines.kernels import pdl
    from engines.kernels.speech_out.flow import conv, gemm

    flow, idx = dec.flow, torch.cuda.current_device()
    est = flow.decoder.estimator
    est.fuse()
    resnets = est._resnets()
    merged = [(r.conv1_res_gemm, r.conv1_res_bias) for r in resnets]
    linear, whole_rows, flat_rows = gemm.linear, conv.CONV_WHOLE_MAX_ROWS, conv.CONV_FLAT_MIN_ROWS

    def cublas(x, w, b=None, residual=None):
        y = torch.nn.functional.linear(x, w, b)
        return y if residual is None else y + residual

    def separate_add(x, w, b=None, residual=None):
        y = linear(x, w, b)
        return y if residual is None else y + residual

    try:
        for batch in batches:
            ref = None
            for name, on, gemms, whole, merge, last, flat in TIMELINE_VARIANTS:
                pdl._enabled[idx] = on
                gemm.linear = cublas if gemms == "cublas" else separate_add if last == "add" else linear
                conv.CONV_WHOLE_MAX_ROWS = whole_rows if whole else 0
                conv.CONV_FLAT_MIN_ROWS = flat_rows if flat else 1 << 62
                for r, (w, b) in zip(resnets, merged, strict=True):
                    r.conv1_res_gemm, r.conv1_res_bias = (w, b) if merge else (None, None)
                ms, x = _solve_ms(flow, batch, reps)
                ref = _print_solve(batch, ms, x, ref, "first", name)
    finally:
        pdl._enabled.pop(idx, None)
        gemm.linear, conv.CONV_WHOLE_MAX_ROWS, conv.CONV_FLAT_MIN_ROWS = linear, whole_rows, flat_rows
        for r, (w, b) in zip(resnets, merged, strict=True):
            r.conv1_res_gemm, r.conv1_res_bias = w, b
    _print_kernel_resources()


def _tile_variants():
    """The served StreamTiles, then one field changed at a time (and a few pairs)."""
    from dataclasses import replace

    from engines.kernels.speech_out.flow.common import STREAM_TILES as s

    out = [("served", s)]
    for v in ((16, 128, 4), (16, 128, 8), (16, 32, 4), (32, 64, 4), (32, 128, 8), (64, 64, 8), (16, 256, 8)):
        out.append((f"ln_linear {v}", replace(s, ln_linear=v)))
    for kw in ({"linear_m": 32}, {"linear_m": 64}, {"linear_tile": 8192}, {"linear_tile": 32768},
               {"linear_warps": 8}, {"linear_warps": 2}, {"conv_m": 32}, {"conv_m": 64}, {"conv_tile": 8192},
               {"conv_tile": 32768}, {"attention_warps": 2}, {"attention_warps": 8},
               {"linear_m": 32, "conv_m": 32, "ln_linear": (32, 64, 4)}):
        out.append((" ".join(f"{k}={v}" for k, v in kw.items()), replace(s, **kw)))
    return out


def _tiles(dec, batches: list[int], reps: int) -> None:
    """The solve graph per StreamTiles variant (flow.common.STREAM_TILES), same inputs for each."""
    from engines.kernels.speech_out.flow import attention, common, conv, gemm

    readers = (conv, gemm, attention)  # the kernel modules that read STREAM_TILES (imported from common)
    served = common.STREAM_TILES
    try:
        for batch in batches:
            ref = None
            for name, tiles in _tile_variants():
                for m in readers:
                    m.STREAM_TILES = tiles
                try:
                    ms, x = _solve_ms(dec.flow, batch, reps)
                except Exception as e:  # a tiling Triton cannot compile (shared memory) is reported, not fatal
                    print(f"solve batch {batch:3d}: failed ({type(e).__name__}: {str(e)[:80]})  {name}", flush=True)
                    continue
                ref = _print_solve(batch, ms, x, ref, "served", name)
    finally:
        for m in readers:
            m.STREAM_TILES = served


def _chains(dec, batches: list[int], reps: int) -> None:
    """The solve graph with the estimator's windows in 1, 2, 4 or 8 chains side by side (FlowModel.solve_chains),
    then by the served rule, same inputs for each."""
    flow = dec.flow
    try:
        for batch in batches:
            ref = None
            for k in [c for c in (1, 2, 4, 8) if c <= 2 * batch] + [None]:
                flow.solve_chains = k
                ms, x = _solve_ms(flow, batch, reps)
                name = "served rule" if k is None else f"{k} chain{'s' if k > 1 else ''}"
                ref = _print_solve(batch, ms, x, ref, "1 chain", name)
    finally:
        flow.solve_chains = None


def _print_kernel_resources() -> None:
    """Registers and spills of every compiled codec kernel variant (spills put tiles in local memory)."""
    from engines.kernels.speech_out.flow import attention, conv, gemm, norms

    for fn in (conv._conv_whole_kernel, conv._causal_conv_kernel, gemm._linear_kernel, gemm._ln_linear_kernel,
               attention._window_attention_kernel, norms._layernorm_mish_kernel, norms._add_layernorm_kernel):
        try:
            for cache in fn.device_caches.values():
                for ck in cache[0].values():
                    print(f"  {fn.fn.__name__}: {ck.n_regs} registers, {ck.n_spills} spills, "
                          f"{ck.metadata.num_warps} warps, {ck.metadata.shared} B shared", flush=True)
        except (AttributeError, KeyError, TypeError) as e:  # Triton internals differ between versions
            print(f"  {fn.fn.__name__}: no resource figures ({type(e).__name__}: {e})")


def main() -> None:
    from engines.speech_out import CodecDecoder

    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="full-random")
    p.add_argument("--vocoder", default="hift")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--compile", action="store_true", help="also time the estimator under torch.compile")
    p.add_argument("--top", type=int, default=0, help="print the N costliest kernels of one estimator call")
    p.add_argument("--host-profile", action="store_true", help="also cProfile the steady-state rounds")
    p.add_argument("--timeline", action="store_true", help="only the solve graph's replay time, per kernel variant")
    p.add_argument("--tiles", action="store_true", help="only the solve graph's replay time, per StreamTiles variant")
    p.add_argument("--chains", action="store_true", help="only the solve graph's replay time, per number of chains")
    a = p.parse_args()
    dec = CodecDecoder.load(a.codec, device="cuda", vocoder=a.vocoder, cuda_graphs=True,
                            estimator_dtype="bfloat16", context="window")
    if a.timeline:
        _timeline(dec, [int(x) for x in a.batches.split(",")], a.iters)
        return
    if a.chains:
        _chains(dec, [int(x) for x in a.batches.split(",")], a.iters)
        return
    if a.tiles:
        _tiles(dec, [int(x) for x in a.batches.split(",")], a.iters)
        _print_kernel_resources()
        return
    for b in [int(x) for x in a.batches.split(",")]:
        n, us = _estimator_kernels(dec, b, a.top)
        print(f"batch {b}: one eager estimator call = {n} kernels, {us / 1e3:.2f} ms GPU time "
              f"(x {dec.cfg.flow.n_timesteps} Euler steps per chunk)")
        rounds = SteadyRounds(dec, b)
        st = _stage_times(dec, rounds, a.iters)
        print(f"batch {b}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in st.items()))
        if a.host_profile:
            _host_profile(rounds, a.iters)
        if a.compile:
            est = dec.flow.decoder.estimator
            t0 = time.perf_counter()
            est.run = torch.compile(est.run, dynamic=False)  # what the Euler solve calls
            dec.flow.graphs = type(dec.flow.graphs)(dec.flow)  # fresh graphs and pool
            st = _stage_times(dec, rounds, a.iters)
            print(f"batch {b} compiled (first use incl. compile+capture {time.perf_counter() - t0:.1f} s): "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in st.items()))
            del est.run
            dec.flow.graphs = type(dec.flow.graphs)(dec.flow)
        rounds.close()


if __name__ == "__main__":
    main()
