"""`moss-speech bench codec`: time per 5-code chunk at several batch sizes, and real-time streams it supports.
By default the decoder is loaded as the engine serves it on the device (engines/speech_out/presets.py
`served_options`): on a GPU CUDA graphs, the estimator in bf16, the flow encoder's matmuls on TF32.

A stream needs one chunk per 0.4 s (5 codes at 12.5 Hz), so streams supported = 0.4 s / (step time / batch).
Timing uses CUDA events on GPU and perf_counter on CPU; a step is a round of the server's codec worker decoding one
steady-state chunk for every session of the batch (each in a voice prompt of `--prompt-codes`) in one batch
(engines/bench/codec_rounds.py: flow + vocoder + crossfade, PCM copied to the host).

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
import sys
import time

import torch

from engines.bench.codec_rounds import SteadyRounds
from engines.bench.hardware import measure_bandwidth, measure_matmul
from engines.config import ConfigError
from engines.speech_out.flow.pages import DecoderCacheFull
from engines.speech_out.presets import served_options
from engines.speech_out.voice import BUNDLED_VOICE_CODES
from moss_speech.commands.arguments import counts, non_negative_int, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="tiny-random", help="tiny-random | full-random | codec directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocoder", default=None, choices=["bigvgan", "hift"],
                   help="default: the engine's (hift for a codec directory without bigvgan/, else bigvgan)")
    p.add_argument("--batches", type=counts, default="1,16,64", help="comma separated batch sizes")
    p.add_argument("--iters", type=positive_int, default=10, help="timed steps per batch size")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help="untimed steps per batch size (default: until the flow encoder's window is full, "
                        "StreamConfig.steady_chunks: earlier steps see new key lengths, each a graph capture); "
                        "the timed steps begin about this many 0.4 s chunks into the answers (50: 20 s)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the flow and the vocoder as CUDA graphs (default: on a GPU, as served)")
    p.add_argument("--no-encoder-graphs", dest="encoder_graphs", action="store_false", default=None,
                   help="with --cuda-graphs, run the flow's encoder eagerly (the server replays it as CUDA graphs)")
    p.add_argument("--estimator-dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: the engine's (bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--context", default="full", choices=["full", "window"],
                   help="the flow's view of earlier chunks, as the engine's --decoder-context (default full)")
    p.add_argument("--cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="with --context full: the element type of the flow's cached keys and values, as the engine's "
                        "--decoder-cache-dtype (default auto: the estimator's)")
    p.add_argument("--prompt-codes", type=non_negative_int, default=BUNDLED_VOICE_CODES,
                   help=f"the sessions' voice prompt, in codes (default {BUNDLED_VOICE_CODES}: the bundled voice's "
                        "length; its keys are read with every chunk); 0: no prompt")
    p.add_argument("--cache-gib", type=float, default=None,
                   help="with --context full: the flow's cache of earlier chunks, as the engine's --decoder-cache-gib "
                        "(default the engine's: 40 GiB or 45%% of the GPU's free memory; answers that outgrow it "
                        "forget their oldest chunks, counted in the report)")
    p.add_argument("--encoder-tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="the flow encoder's float32 matmuls on TF32 tensor cores (default: on a GPU, as served)")


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


def _time_step(rounds: SteadyRounds, device: torch.device) -> tuple[float, int]:
    """One round's ms and the chunks it decoded (none for an answer whose first job still waits for codes)."""
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
    return ms, sum(p.size > 0 for p in out)


def load_options(args: argparse.Namespace, on_gpu: bool) -> dict:
    """CodecDecoder.load's settings: the engine's on this device (served_options), each one given overriding it."""
    opts = served_options(args.codec, on_gpu, args.vocoder)
    for key in ("cuda_graphs", "encoder_graphs", "encoder_tf32", "estimator_dtype"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    return opts


def run(args: argparse.Namespace) -> int:
    from engines.speech_out import CodecDecoder, Voice

    device = torch.device(args.device)
    opts = load_options(args, device.type == "cuda")
    try:
        dec = CodecDecoder.load(args.codec, device=device, context=args.context, cache_gib=args.cache_gib,
                                cache_dtype=args.cache_dtype, **opts)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prompt_codes > dec.cfg.stream.max_prompt_codes:
        print(f"error: --prompt-codes {args.prompt_codes} exceeds a voice prompt's {dec.cfg.stream.max_prompt_codes} "
              "codes", file=sys.stderr)
        return 2
    chunk = dec.cfg.stream.chunk_codes
    hw = hardware(device)
    print(f"hardware: {hw}")
    print(f"measured: copy {hw['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
          f"{hw['matmul_flop_per_s'] / 1e12:.1f} TFLOP/s ({hw['matmul_dtype']})")
    cache = (f", its cache {dec.full.pages.n_pages} pages{' in fp8' if args.cache_dtype == 'fp8' else ''}"
             if dec.full is not None else "")
    print(f"codec {dec.source}, context {args.context}, vocoder {opts['vocoder']}, cuda graphs "
          f"{dec.flow.graphs is not None or dec.full_graphs is not None} "
          f"(encoder {dec.flow.enc_graphs is not None or dec.full_enc_graphs is not None}), "
          f"dtype {dec.flow.dtype}{' (matmuls TF32)' if opts['encoder_tf32'] else ''}, estimator "
          f"{opts['estimator_dtype']}{cache}, voice prompt {args.prompt_codes} codes, "
          f"chunk {chunk} codes = "
          f"{chunk * dec.samples_per_code} samples ({chunk * dec.samples_per_code / dec.sample_rate:.2f} s)")
    warmup = args.warmup if args.warmup is not None else dec.cfg.stream.steady_chunks
    results = []
    batches = args.batches
    floors = solve_floors_ms(dec, batches, hw)
    fc = dec.cfg.flow
    if args.prompt_codes:  # the sessions' voice, as the engine's default voice (whose first jobs it captures)
        dec.default_voice = Voice.random(seed=3, n_codes=args.prompt_codes, n_mels=fc.output_size,
                                         spk_dim=fc.spk_embed_dim)
    t0 = time.perf_counter()
    captured = dec.capture_graphs(max(batches))  # as the engine's start does: no capture inside a timed step
    if captured:
        print(f"{captured} CUDA graphs captured in {time.perf_counter() - t0:.1f} s")
    for b in batches:
        rounds = SteadyRounds(dec, b)
        try:
            for _ in range(warmup):
                _time_step(rounds, device)
            forgotten = dec.full.forgotten if dec.full is not None else 0
            timed = [_time_step(rounds, device) for _ in range(args.iters)]
            state_bytes = rounds.streams[0].state_bytes()
        except DecoderCacheFull as e:  # every answer keeps at least its last chunks (FullContextFlow.kept_pages)
            print(f"error: batch {b}: {e}: the cache is too small for {b} answers this long (--cache-gib)",
                  file=sys.stderr)
            return 1
        finally:  # the batch's answers give their pages back, an error or not
            rounds.close()
        if any(n < b for _, n in timed):  # an answer's first job waits for its prompt's tail and more codes
            print(f"error: batch {b}: a timed step decoded fewer than {b} chunks: give --warmup 2 or more",
                  file=sys.stderr)
            return 2
        times = [ms for ms, _ in timed]
        ms = statistics.median(times)
        per_chunk = ms / b
        streams = 0.4 / (per_chunk / 1e3)
        row = {"batch": b, "step_ms_median": round(ms, 3), "step_ms_min": round(min(times), 3),
               "ms_per_chunk": round(per_chunk, 3), "streams_supported": int(streams),
               "state_bytes_per_session": state_bytes,
               "solve_floor_ms": round(floors[b], 4)}
        if dec.full is not None:  # pages the timed steps' answers forgot: their context was cut short
            row["chunks_forgotten_timed"] = dec.full.forgotten - forgotten
        results.append(row)
        cut = (f"; {row['chunks_forgotten_timed']} earlier chunks forgotten in the timed steps (the cache ran short)"
               if row.get("chunks_forgotten_timed") else "")
        print(f"batch {b:3d}: step {ms:8.2f} ms (min {min(times):.2f}), {per_chunk:7.3f} ms per chunk, "
              f"real-time streams supported: {int(streams)}; the solve's floor {row['solve_floor_ms']:.3f} ms{cut}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hw, "codec": dec.source, **opts, "context": args.context,
                       "cache_pages": dec.full.pages.n_pages if dec.full is not None else None,
                       "cache_dtype": args.cache_dtype, "prompt_codes": args.prompt_codes,
                       "warmup_steps": warmup, "results": results}, f,
                      indent=1)
    return 0
