"""The decode attention alone over a bf16 and an fp8 KV cache (EngineConfig.kv_dtype), against the byte floor of each.

    python3 -m engines.profiling.decode_attention [--batches 1,8,16,64,128] [--contexts 300,1000,4000] [--json OUT]

Every sequence of a batch has the same context. Each timing is a CUDA graph of one launch per layer over caches of
their own (as many layers as keep the caches well past the L2, at most the model's 40), replayed; the figure is the
time per launch. The floor is the launch's K/V bytes at the copy rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch

from engines.bench.hardware import device_name, graphed_us, measure_bandwidth
from engines.config import ModelConfig, to_cache
from engines.kernels.lm.paged_decode import num_splits, paged_decode_attention

PAGE = 16
L2_MULTIPLE_BYTES = 256 << 20  # caches of all layers together at least this large: no layer's K/V left in the L2
REPLAYS = 20


def _case(batch: int, ctx: int, layers: int, mc: ModelConfig, dev: torch.device, g: torch.Generator):
    blocks = -(-ctx // PAGE)
    n = batch * blocks
    tables = torch.stack([torch.randperm(n, device=dev, generator=g)[:blocks] for _ in range(batch)])  # [B, blocks]
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.long)
    q = torch.randn(batch, mc.num_attention_heads, mc.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
    caches = [torch.randn(2, n, PAGE, mc.num_key_value_heads, mc.head_dim, device=dev, dtype=torch.bfloat16,
                          generator=g) for _ in range(layers)]  # [k/v, blocks, page, kv_heads, d] per layer
    return q, tables, lens, caches


def _us_per_launch(q, tables, lens, caches) -> float:
    scale = q.shape[-1] ** -0.5

    def step():
        for c in caches:
            paged_decode_attention(q, c[0], c[1], tables, lens, scale)

    return graphed_us(step, len(caches), REPLAYS)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,16,64,128")
    p.add_argument("--contexts", default="300,1000,4000")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    mc = ModelConfig()
    bw = measure_bandwidth(dev, 2 << 30)
    print(f"{device_name(dev)}: copy {bw / 1e12:.2f} TB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            bf16_bytes = batch * ctx * mc.num_key_value_heads * mc.head_dim * 2 * 2  # K and V of one layer
            layers = max(2, min(mc.num_attention_layers, -(-L2_MULTIPLE_BYTES // bf16_bytes)))
            q, tables, lens, caches = _case(batch, ctx, layers, mc, dev, g)
            bf16_us = _us_per_launch(q, tables, lens, caches)
            caches = [to_cache(c, torch.float8_e4m3fn) for c in caches]
            fp8_us = _us_per_launch(q, tables, lens, caches)
            del caches
            torch.cuda.empty_cache()
            floor = bf16_bytes / bw * 1e6
            row = {"batch": batch, "context": ctx, "splits": num_splits(batch, mc.num_key_value_heads, dev),
                   "fp8_splits": num_splits(batch, mc.num_key_value_heads, dev, fp8=True),
                   "layers_timed": layers, "bf16_us": bf16_us, "fp8_us": fp8_us, "bf16_floor_us": floor,
                   "fp8_floor_us": floor / 2}
            rows.append(row)
            print(f"batch {batch:4d} context {ctx:5d} ({row['splits']:2d} / {row['fp8_splits']:2d} splits): "
                  f"bf16 {bf16_us:7.2f} us (floor {floor:6.2f}, {floor / bf16_us:4.0%}), "
                  f"fp8 {fp8_us:7.2f} us (floor {floor / 2:6.2f}, {floor / 2 / fp8_us:4.0%}): "
                  f"{bf16_us / fp8_us:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(dev), "copy_bytes_per_s": bw, "model": "full-random", "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
