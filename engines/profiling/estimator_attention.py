"""The full-context estimator's paged attention alone, per launch configuration, against its byte floor.

    python3 -m engines.profiling.estimator_attention [--batches 1,16,64] [--pages 16,42] [--configs 128,4,3,2 ...]
        [--cache-dtype auto,fp8] [--json OUT]

Each row of a batch attends with one chunk (20 frames, both classifier-free-guidance branches) over `pages` earlier
pages: the voice's 14, shared by every row, then pages of its own (42: a served answer past ~11 s). A config is
BLOCK_T,NUM_WARPS,NUM_STAGES,PROGRAMS_PER_SM of engines/kernels/speech_out/flow/paged_attention.py. Each timing is a
CUDA graph of one launch per block over pools of their own (as many blocks as keep them well past the L2, at most the
estimator's 56), replayed; the figure is the time per launch. The floor is the launch's key and value bytes at the
copy rate measured in the same run: pages in bf16 (auto) or fp8 (`--decoder-cache-dtype fp8`), half the bytes.
"""

from __future__ import annotations

import argparse
import json

import torch

from engines.bench.hardware import device_name, graphed_us, measure_bandwidth
from engines.config import kv_torch_dtype, to_cache
from engines.kernels.speech_out.flow import paged_attention as pa

FRAMES, HEADS, HEAD_DIM, VOICE_PAGES, MAX_BLOCKS = 20, 8, 64, 14, 56
L2_MULTIPLE_BYTES = 256 << 20
REPLAYS = 20


def _case(batch: int, pages: int, dev: torch.device, g: torch.Generator):
    """q [2B, F, HD], table [B, pages + 1] (the voice's, the row's own, its new chunk's), n_keys, n_new, pool size."""
    own = pages - VOICE_PAGES
    n_pages = VOICE_PAGES + batch * (own + 1)
    rows = [list(range(VOICE_PAGES)) + list(range(VOICE_PAGES + b * (own + 1), VOICE_PAGES + (b + 1) * (own + 1)))
            for b in range(batch)]
    table = torch.tensor(rows, device=dev)
    n_keys = torch.full((batch,), pages * FRAMES, device=dev)
    n_new = torch.full((batch,), FRAMES, device=dev)
    q = torch.randn(2 * batch, FRAMES, HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    return q, table, n_keys, n_new, n_pages


def _us_per_launch(q, table, n_keys, n_new, pools) -> float:
    def step():
        for p in pools:
            pa.paged_attention(q, p, table, n_keys, n_new, HEADS, FRAMES)

    return graphed_us(step, len(pools), REPLAYS)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--pages", default="16,42")
    p.add_argument("--configs", nargs="+",
                   default=[f"{pa.BLOCK_T},{pa.NUM_WARPS},{pa.NUM_STAGES},{pa.PROGRAMS_PER_SM}"])
    p.add_argument("--cache-dtype", default="auto", help="comma separated: auto (bf16 pages), fp8")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev, 2 << 30)
    print(f"{device_name(dev)}: copy {bw / 1e12:.2f} TB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for pages, batch, kind in ((int(p), int(b), k) for p in args.pages.split(",") for b in args.batches.split(",")
                               for k in args.cache_dtype.split(",")):
        q, table, n_keys, n_new, n_pages = _case(batch, pages, dev, g)
        dtype = kv_torch_dtype(kind, torch.bfloat16)
        nbytes = 2 * batch * (pages + 1) * FRAMES * HEADS * HEAD_DIM * 2 * dtype.itemsize  # rows x keys x (k, v)
        blocks = max(2, min(MAX_BLOCKS, -(-L2_MULTIPLE_BYTES // nbytes)))
        pools = [to_cache(torch.randn(2, 2, n_pages, FRAMES, HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16,
                                      generator=g), dtype) for _ in range(blocks)]
        floor = nbytes / bw * 1e6
        for cfg in args.configs:
            pa.BLOCK_T, pa.NUM_WARPS, pa.NUM_STAGES, pa.PROGRAMS_PER_SM = (int(x) for x in cfg.split(","))
            splits = pa.num_splits(2 * batch * HEADS, dev)
            us = _us_per_launch(q, table, n_keys, n_new, pools)
            rows.append({"batch": batch, "pages": pages, "cache_dtype": kind, "config": cfg, "splits": splits,
                         "us": us, "floor_us": floor})
            print(f"batch {batch:3d} pages {pages:3d} {kind:4s} config {cfg:12s} ({splits:2d} splits): {us:7.1f} us "
                  f"(floor {floor:6.1f}, {floor / us:4.0%})", flush=True)
        del pools
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(dev), "copy_bytes_per_s": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
