"""`moss-speech bench codec`: time per 5-code chunk at several batch sizes, and real-time streams it supports.

A stream needs one chunk per 0.4 s (5 codes at 12.5 Hz), so streams supported = 0.4 s / (step time / batch).
Timing uses CUDA events on GPU and perf_counter on CPU; a step is a round of the server's codec worker decoding one
steady-state chunk for every session of the batch in one batch (engines/bench/codec_rounds.py: flow + vocoder +
crossfade, PCM copied to the host).

Beside each step, the Euler solve's floor on this machine, from its memory bandwidth and matmul rate measured in the
same run: every Euler step reads all the estimator's weights once and multiplies each by every row of the CFG
windows (2 x batch x window frames), so a solve takes at least steps x max(weight bytes / bandwidth, 2 x params x
rows / matmul rate). It leaves out the flow encoder and the vocoder (their conv FLOPs do not follow from their
sizes) and the time every dependent kernel takes to start, which bounds batch 1 (docs/performance.md, Codec decoder).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from engines.bench.codec_rounds import SteadyRounds
from engines.bench.hardware import measure_bandwidth, measure_matmul


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="tiny-random", help="tiny-random | full-random | codec directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocoder", default="bigvgan", choices=["bigvgan", "hift"])
    p.add_argument("--batches", default="1,16,64", help="comma separated batch sizes")
    p.add_argument("--iters", type=int, default=10, help="timed steps per batch size")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per batch size (default: until the flow encoder's window is full, "
                        "StreamConfig.steady_chunks: earlier steps see new key lengths, each a graph capture)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--cuda-graphs", action="store_true", help="replay the flow's Euler solve as CUDA graphs")
    p.add_argument("--no-encoder-graphs", dest="encoder_graphs", action="store_false",
                   help="with --cuda-graphs, run the flow's encoder eagerly (the server replays it as CUDA graphs)")
    p.add_argument("--estimator-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--context", default="full", choices=["full", "window"],
                   help="the flow's view of earlier chunks, as the engine's --decoder-context (default full)")
    p.add_argument("--cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="with --context full: the element type of the flow's cached keys and values, as the engine's "
                        "--decoder-cache-dtype (default auto: the estimator's)")
    p.add_argument("--encoder-tf32", action="store_true",
                   help="the flow encoder's float32 matmuls on TF32 tensor cores (the server's setting on a GPU)")


def hardware(device: torch.device) -> dict:
    hw = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
          "threads": torch.get_num_threads()}
    on_gpu = device.type == "cuda"
    if on_gpu:
        p = torch.cuda.get_device_properties(device)
        hw.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    mm_dtype = torch.bfloat16 if on_gpu else torch.float32
    hw["copy_bytes_per_s"] = measure_bandwidth(device, 2 << 30 if on_gpu else 64 << 20)
    hw["matmul_flop_per_s"] = measure_matmul(device, 8192 if on_gpu else 512, mm_dtype)
    hw["matmul_dtype"] = str(mm_dtype).removeprefix("torch.")
    return hw


def solve_floors_ms(dec, batches: list[int], hw: dict) -> dict[int, float]:
    """The Euler solve's floor for each batch of sessions on this machine (module docstring)."""
    params = weight_bytes = 0
    for p in dec.flow.decoder.estimator.parameters():
        params += p.numel()
        weight_bytes += p.numel() * p.element_size()
    stream = dec.cfg.stream
    # frames per CFG pass: the windowed flow runs its context frames again, the full-context one only the chunk's
    window = (stream.est_ctx_frames if dec.full is None else 0) + stream.chunk_codes * dec.cfg.flow.token_mel_ratio
    return {b: dec.cfg.flow.n_timesteps * 1e3 * max(weight_bytes / hw["copy_bytes_per_s"],
                                                    2 * params * (2 * b * window) / hw["matmul_flop_per_s"])
            for b in batches}


def _time_step(rounds: SteadyRounds, device: torch.device) -> float:
    rounds.feed()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record(rounds.cuda_stream)
        out = rounds.decode()
        end.record(rounds.cuda_stream)
        torch.cuda.synchronize(device)
        ms = start.elapsed_time(end)
    else:
        t0 = time.perf_counter()
        out = rounds.decode()
        ms = (time.perf_counter() - t0) * 1e3
    assert len(out) == len(rounds.streams)
    return ms


def run(args: argparse.Namespace) -> int:
    from engines.speech_out import CodecDecoder

    device = torch.device(args.device)
    dec = CodecDecoder.load(args.codec, device=device, vocoder=args.vocoder, cuda_graphs=args.cuda_graphs,
                            estimator_dtype=args.estimator_dtype, encoder_graphs=args.encoder_graphs,
                            encoder_tf32=args.encoder_tf32, context=args.context,
                            cache_dtype=args.cache_dtype)
    chunk = dec.cfg.stream.chunk_codes
    hw = hardware(device)
    print(f"hardware: {hw}")
    print(f"measured: copy {hw['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
          f"{hw['matmul_flop_per_s'] / 1e12:.1f} TFLOP/s ({hw['matmul_dtype']})")
    print(f"codec {dec.source}, context {args.context}, vocoder {args.vocoder}, cuda graphs "
          f"{dec.flow.graphs is not None or dec.full_graphs is not None} "
          f"(encoder {dec.flow.enc_graphs is not None}), "
          f"dtype {dec.flow.dtype}{' (matmuls TF32)' if args.encoder_tf32 else ''}, estimator "
          f"{args.estimator_dtype}{', its cache fp8' if dec.full and args.cache_dtype == 'fp8' else ''}, "
          f"chunk {chunk} codes = "
          f"{chunk * dec.samples_per_code} samples ({chunk * dec.samples_per_code / dec.sample_rate:.2f} s)")
    warmup = args.warmup if args.warmup is not None else dec.cfg.stream.steady_chunks
    results = []
    batches = [int(x) for x in args.batches.split(",")]
    floors = solve_floors_ms(dec, batches, hw)
    for b in batches:
        rounds = SteadyRounds(dec, b)
        for _ in range(warmup):
            _time_step(rounds, device)
        times = [_time_step(rounds, device) for _ in range(args.iters)]
        ms = statistics.median(times)
        per_chunk = ms / b
        streams = 0.4 / (per_chunk / 1e3)
        row = {"batch": b, "step_ms_median": round(ms, 3), "step_ms_min": round(min(times), 3),
               "ms_per_chunk": round(per_chunk, 3), "streams_supported": int(streams),
               "state_bytes_per_session": rounds.streams[0].state_bytes(),
               "solve_floor_ms": round(floors[b], 4)}
        results.append(row)
        print(f"batch {b:3d}: step {ms:8.2f} ms (min {min(times):.2f}), {per_chunk:7.3f} ms per chunk, "
              f"real-time streams supported: {int(streams)}; the solve's floor {row['solve_floor_ms']:.3f} ms")
        rounds.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hw, "codec": dec.source, "vocoder": args.vocoder,
                       "cuda_graphs": dec.flow.graphs is not None, "encoder_graphs": dec.flow.enc_graphs is not None,
                       "estimator_dtype": args.estimator_dtype, "encoder_tf32": args.encoder_tf32,
                       "context": args.context, "cache_dtype": args.cache_dtype,
                       "warmup_steps": warmup, "results": results}, f,
                      indent=1)
    return 0
