"""`moss-speech bench engine`: prefill and decode step times, engine TTFA, next to the HF-style baseline
and the physical floors measured in the same run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from engines.api import ChannelSampling, SamplingParams
from engines.bench.hardware import device_name, measure_bandwidth, measure_matmul, median, sync, timed
from engines.bench.hf_baseline import HFStyleModel
from engines.config import KV_DTYPES, EngineConfig, kv_torch_dtype, model_config_for
from engines.lm.engine import Engine
from engines.tokens import AUDIO_PAD, EOSP, SOSP
from moss_speech.commands.arguments import counts

TTFA_CODES = 64  # audio codes the engine TTFA's request asks for (its first audio waits for fewer)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batches", type=counts, default="1,8,32,64")
    p.add_argument("--context", type=int, default=1024, help="rows of context per sequence for decode timing")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--first-audio-codes", type=int, default=10,
                   help="audio codes the first audio waits for: 10 with the full-context decoder (the default) and the "
                        "bundled voice (8-12 by a voice's prompt tail), 8 with --decoder-context window")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--kv-gib", type=float, default=None, help="KV pool size (default: fits the largest batch)")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--fp8-weights", action="store_true", help="EngineConfig.fp8_weights: the weights rounded to fp8, "
                   "decode steps reading an fp8 copy (the baseline runs the same rounded weights in bf16)")
    p.add_argument("--fp8-only", action="store_true", help="EngineConfig.fp8_only: with --fp8-weights, only the fp8 "
                   "copies are kept (needs --no-baseline: the HF-style baseline multiplies bf16 weights)")
    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="auto",
                   help="EngineConfig.kv_dtype: fp8 stores the KV cache as e4m3 (the floor counts its bytes)")
    p.add_argument("--json", default=None, help="write the results here")


def _rows(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """n rows of random text ending in sosp: generation runs in audio mode (the voice path)."""
    return [(rng.randrange(200, 150000), AUDIO_PAD) for _ in range(n - 1)] + [(SOSP, AUDIO_PAD)]


def _audio_forever(n: int, seed: int = 0) -> SamplingParams:
    # min_new_tokens = max_new_tokens keeps eosp masked, so the stream stays in audio mode.
    ch = ChannelSampling()
    return SamplingParams(text=ch, audio=ch, max_new_tokens=n, min_new_tokens=n, seed=seed)


def add_decode_batch_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The options of a tool timing decode batches (`decode_batch_config`, `start_decode_batch`)."""
    p.add_argument("--model", default="full-random")
    p.add_argument("--batches", type=counts, default="1,64", help="comma separated batch sizes")
    p.add_argument("--context", type=int, default=1024, help="rows of context per sequence")
    p.add_argument("--steps", type=int, default=steps, help="decode steps per timed loop")


def decode_batch_config(model: str, max_batch: int, context: int, new_rows: int, device: str = "cuda",
                        fp8_weights: bool = False, fp8_only: bool = False) -> EngineConfig:
    """An engine for decode batches of up to `max_batch` sequences of `context` rows plus `new_rows` generated."""
    mc = model_config_for(model)
    return EngineConfig(device=device, dtype="bfloat16" if device == "cuda" else "float32", max_running=max_batch,
                        prefill_token_budget=1024, max_model_len=context + new_rows + 128,
                        kv_cache_bytes=mc.kv_bytes_per_row() * (max_batch * (context + new_rows + 64) + 4096),
                        fp8_weights=fp8_weights, fp8_only=fp8_only)


def start_decode_batch(engine: Engine, rng: random.Random, batch: int, context: int, max_new: int) -> None:
    """`batch` audio-mode requests of `context` rows each (names d0..), stepped until every one is decoding."""
    for i in range(batch):
        engine.add_request(f"d{i}", _rows(rng, context - 1), _audio_forever(max_new, seed=i))
    while any(s.num_generated == 0 for s in engine.scheduler.requests.values()):
        engine.step()


def _drain(engine: Engine) -> None:
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    while engine.has_work():
        engine.step()


def weight_bytes(model: torch.nn.Module, with_text_head: bool, rows: int = 1) -> int:
    """Bytes a decode step of `rows` rows must read: every layer, norm and the heads it uses (embeddings: a few rows
    only); a layer's fp8 copy instead of its weight where the step's GEMMs read it (fp8.MAX_ROWS, or no weight)."""
    from engines.lm.model import fp8
    from engines.lm.model.layers import Linear

    skip = {"embed_tokens", "audio_embed"} | (set() if with_text_head else {"text_lm_head"})
    total = 0
    for name, m in model.named_modules():
        if name in skip:
            continue
        if isinstance(m, Linear) and m.fp8 is not None and (m.weight is None or rows <= fp8.MAX_ROWS):
            total += sum(t.numel() * t.element_size() for t in m.fp8)
        else:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def matmul_params(model: torch.nn.Module) -> int:
    """Multiply-adds per row of the decoder layers' linear layers (their weights, or fp8 copies where dropped)."""
    from engines.lm.model.layers import Linear

    return sum(m.fp8[0].numel() if m.weight is None else m.weight.numel() for n, m in model.named_modules()
               if n.startswith("layers.") and isinstance(m, Linear))


def _baseline_decode_ms(model, batch: int, ctx: int, repeats: int, device: torch.device) -> float:
    base = HFStyleModel(model, batch, ctx + repeats + 8)
    rows = torch.tensor([[(SOSP, AUDIO_PAD)]] * batch, device=device)
    pos = iter(range(ctx, ctx + 1000))
    return median(timed(lambda: base.forward(rows, next(pos)), device, repeats=repeats, warmup=2)) * 1e3


def run(args: argparse.Namespace) -> int:
    if args.fp8_only and not args.no_baseline:
        raise SystemExit("bench engine: --fp8-only needs --no-baseline (the model keeps no bf16 weights for the "
                         "HF-style baseline; run it without --fp8-only for that)")
    if not 1 <= args.first_audio_codes <= TTFA_CODES:
        raise SystemExit(f"bench engine: --first-audio-codes must be 1-{TTFA_CODES}, got {args.first_audio_codes}")
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    batches = args.batches
    max_b = max(batches)
    ctx = args.context
    steps = args.steps
    # Sequences admitted first decode while the others prefill (~ctx x batch / row budget steps), and
    # must still be running, all of them, when the timed decode steps start.
    prefill_steps = -(-max_b * ctx // max(args.prefill, max_b + 1)) + 8
    max_len = max(ctx, args.prefill) + 2 * steps + 64 + prefill_steps
    rng = random.Random(0)

    bw = measure_bandwidth(device, 2 << 30 if device.type == "cuda" else 256 << 20)
    mm = measure_matmul(device, 8192 if device.type == "cuda" else 1024,
                        torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(f"device: {device_name(device)}  bandwidth {bw / 1e12:.2f} TB/s  matmul {mm / 1e12:.1f} TFLOP/s")

    mc = model_config_for(args.model)
    kv_bytes = int(args.kv_gib * 2**30) if args.kv_gib else (max_b * (max_len + EngineConfig.block_size) + 4096) * \
        mc.kv_bytes_per_row(kv_torch_dtype(args.kv_dtype, dtype))
    cfg = EngineConfig(device=args.device, dtype=dtype, kv_cache_bytes=kv_bytes, max_running=max_b,
                       prefill_token_budget=max(args.prefill, max_b + 1) + max_b, max_model_len=max_len + 64,
                       max_waiting=max_b + 8, cuda_graphs=not args.no_graphs, fp8_weights=args.fp8_weights,
                       fp8_only=args.fp8_only, kv_dtype=args.kv_dtype,
                       ramp_step_rows=0)  # no cap on prefill beside new answers: batches fill in prefill_steps
    engine = Engine.from_name(args.model, cfg, seed=0)
    model = engine.runner.model
    w_audio, w_text = weight_bytes(model, False), weight_bytes(model, True)
    kv_row = mc.kv_bytes_per_row(cfg.kv_torch_dtype)
    res: dict = {"device": device_name(device), "model": args.model, "dtype": dtype,
                 "hbm_bandwidth_bytes_per_s": bw, "matmul_flops_per_s": mm, "weight_bytes_decode_audio": w_audio,
                 "weight_bytes_decode_text": w_text, "kv_bytes_per_row": kv_row, "context_rows": ctx,
                 "cuda_graphs": engine.runner.graphs is not None, "fp8_weights": args.fp8_weights,
                 "fp8_only": args.fp8_only, "kv_dtype": args.kv_dtype}

    # Prefill of N rows (the step that runs them and samples the first row), without the first decode step that
    # the engine launches in the same call for a spoken answer (overlap off for this measurement only).
    def prefill_once():
        engine.add_request("p", _rows(rng, args.prefill), _audio_forever(8))
        engine.step()
        sync(device)

    def prefill_timed():
        overlap, engine.config = engine.config, dataclasses.replace(engine.config, overlap=False)
        t = timed(prefill_once, device, repeats=1, warmup=0)[0]
        engine.config = overlap
        _drain(engine)
        return t
    prefill_timed()
    res["prefill_512_ms"] = median([prefill_timed() for _ in range(5)]) * 1e3
    flops = 2 * matmul_params(model) * args.prefill + 2 * mc.hidden_size * mc.audio_vocab_size
    flops += 4 * mc.num_attention_layers * mc.num_attention_heads * mc.head_dim * args.prefill ** 2 / 2
    res["floor_prefill_512_ms"] = flops / mm * 1e3

    # Engine TTFA: prefill + decode until the codes the first audio waits for (its first codec job with their
    # lookahead) are on the host, from an idle GPU. The step launched ahead of the last one's is still running then:
    # not counted.
    def ttfa_once() -> float:
        sync(device)
        t0 = time.perf_counter()
        engine.add_request("t", _rows(rng, args.prefill), _audio_forever(TTFA_CODES))
        codes = 0
        while codes < args.first_audio_codes:
            codes += sum(1 for o in engine.step() if o.mode == "audio" and o.audio_token < EOSP)
        t = time.perf_counter() - t0
        _drain(engine)
        return t
    ttfa_once()
    res["engine_ttfa_ms"] = median([ttfa_once() for _ in range(3)]) * 1e3
    res["engine_ttfa_codes"] = args.first_audio_codes

    # Decode steps at each batch size with `ctx`-row contexts.
    res["decode_step_ms"], res["floor_decode_step_ms"] = {}, {}
    for b in batches:
        start_decode_batch(engine, rng, b, ctx, 2 * steps + 24 + prefill_steps)
        if len(engine.scheduler.running) != b:
            raise RuntimeError(f"decode batch {b}: only {len(engine.scheduler.running)} sequences running")
        # KV rows read per step on average over the loop (the first admitted decoded while others prefilled)
        kv_rows = sum(s.num_computed for s in engine.scheduler.running) + b * steps / 2
        # A decode loop: consecutive steps, synchronised only at the ends (each step may launch the next
        # before reading its own tokens), after a few steps that settle the allocators (the host's pinned-memory
        # cache fills in the first steps after the batch's prefill). The per-step synchronised median is kept for
        # comparison.
        for _ in range(6):
            engine.step()
        loop = timed(lambda: [engine.step() for _ in range(steps)], device, repeats=1, warmup=0)[0]
        res["decode_step_ms"][str(b)] = loop / steps * 1e3
        res.setdefault("decode_step_ms_synced_each", {})[str(b)] = median(
            timed(engine.step, device, repeats=steps, warmup=2)) * 1e3
        if len(engine.scheduler.running) != b:
            raise RuntimeError(f"decode batch {b}: a sequence finished during the timed steps")
        res["floor_decode_step_ms"][str(b)] = (weight_bytes(model, False, b) + kv_rows * kv_row) / bw * 1e3
        _drain(engine)
        print(f"decode batch {b:3d}: {res['decode_step_ms'][str(b)]:8.2f} ms  "
              f"(floor {res['floor_decode_step_ms'][str(b)]:.2f} ms)")
    engine.check_integrity()

    if not args.no_baseline:
        res["baseline_decode_step_ms"] = {}
        for b in sorted({batches[0], max_b}):
            res["baseline_decode_step_ms"][str(b)] = _baseline_decode_ms(model, b, ctx, min(steps, 10), device)
        base = HFStyleModel(model, 1, args.prefill + 8)
        prows = torch.tensor([_rows(rng, args.prefill)], device=device)
        res["baseline_prefill_512_ms"] = median(timed(lambda: base.forward(prows, 0), device, repeats=5)) * 1e3
        del base

    res["ratio_decode_to_floor"] = {b: res["decode_step_ms"][b] / res["floor_decode_step_ms"][b]
                                    for b in res["decode_step_ms"]}
    res["ratio_prefill_to_floor"] = res["prefill_512_ms"] / res["floor_prefill_512_ms"]
    res["kv_bytes_per_session_1k_rows"] = kv_row * 1024
    print(f"prefill {args.prefill}: {res['prefill_512_ms']:.2f} ms (floor {res['floor_prefill_512_ms']:.2f} ms)"
          + (f", baseline {res['baseline_prefill_512_ms']:.2f} ms" if "baseline_prefill_512_ms" in res else ""))
    print(f"engine TTFA (prefill {args.prefill} + {args.first_audio_codes} audio codes): "
          f"{res['engine_ttfa_ms']:.2f} ms")
    if "baseline_decode_step_ms" in res:
        print("baseline decode:", {k: round(v, 2) for k, v in res["baseline_decode_step_ms"].items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
