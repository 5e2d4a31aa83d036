"""Skinny GEMM vs cuBLAS on the model's decode shapes: `python3 -m engines.profiling.skinny_gemm [--json PATH]`.

Times every candidate tiling (weights rotated over copies larger than L2) and reports bandwidth
against the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton

from engines.bench.hardware import device_name, measure_bandwidth, measure_matmul
from engines.kernels.lm import skinny_gemm
from engines.kernels.lm.gemm_common import time_per_call

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "audio_head": (16512, 4096)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--wide", default="", help="also rows beyond MAX_ROWS (e.g. 32,48,64): cuBLAS against every "
                   "candidate tiling with one tile of the next power-of-two rows")
    p.add_argument("--fp8", default="", help="also the fp8 copy of each weight (engines/lm/model/fp8.py) at these rows "
                   "(e.g. 1,8,16,32,64,128,512): every skinny tiling to 64 rows, every fp8 GEMM tiling from 33, "
                   "against the bf16 weight's best and cuBLAS")
    a = p.parse_args()
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev, 1 << 30)
    mm = measure_matmul(dev, 8192, torch.bfloat16)
    print(f"{device_name(dev)}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    report = {"device": device_name(dev), "copy_bandwidth_bytes_per_s": bw, "bf16_matmul_flops": mm, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        nbytes = w.numel() * 2
        choice = skinny_gemm.tune(w)
        t = skinny_gemm.timings[(n, k, torch.bfloat16, skinny_gemm.MAX_ROWS)]
        ranked = sorted(((v, c) for c, v in t.items()), key=lambda vc: vc[0])
        best_t, best_c = next((v, c) for v, c in ranked if c != "cublas")
        copies = [w] + [torch.randn_like(w) for _ in range(max(0, math.ceil((256 << 20) / nbytes) - 1))]
        rows = {}
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            tc = time_per_call(lambda ww, x=x: F.linear(x, ww), copies, rounds=10)
            tt = time_per_call(lambda ww, x=x, c=best_c: skinny_gemm.launch(x, ww, c), copies, rounds=10)
            rows[m] = {"cublas_us": tc * 1e6, "triton_us": tt * 1e6, "cublas_frac_bw": nbytes / tc / bw,
                       "triton_frac_bw": nbytes / tt / bw}
        wide = {m: _bf16_rows(m, copies)[1:] for m in (int(r) for r in a.wide.split(",") if r)}
        fp8 = {m: _fp8_rows(m, copies, bw) for m in (int(r) for r in a.fp8.split(",") if r)}
        del copies
        report["shapes"][name] = {"n": n, "k": k, "choice": list(choice) if choice else None,
                                  "best_triton": list(best_c), "by_rows": rows,
                                  "tune_us": {str(c): v * 1e6 for c, v in t.items()}}
        print(f"{name} {n}x{k}: choice {choice}, best triton {best_c} {best_t * 1e6:.1f} us "
              f"({nbytes / best_t / bw:.0%} of copy bw), cublas {t['cublas'] * 1e6:.1f} us "
              f"({nbytes / t['cublas'] / bw:.0%})")
        for m, r in rows.items():
            print(f"   M={m:2d}: cublas {r['cublas_us']:7.1f} us ({r['cublas_frac_bw']:.0%})  "
                  f"triton {r['triton_us']:7.1f} us ({r['triton_frac_bw']:.0%})")
        print("   top5:", ", ".join(f"{c}={v * 1e6:.1f}" for v, c in ranked[:5]))
        for m, (block_m, tc, tt) in wide.items():
            bc = min(tt, key=tt.__getitem__)
            rows[m] = {"cublas_us": tc * 1e6, "triton_us": tt[bc] * 1e6, "cublas_frac_bw": nbytes / tc / bw,
                       "triton_frac_bw": nbytes / tt[bc] / bw, "block_m": block_m, "best": list(bc)}
            print(f"   M={m:2d} (tile {block_m}): cublas {tc * 1e6:7.1f} us ({nbytes / tc / bw:.0%})  best triton "
                  f"{bc} {tt[bc] * 1e6:7.1f} us ({nbytes / tt[bc] / bw:.0%})", flush=True)
        for m, r in fp8.items():
            report["shapes"][name].setdefault("fp8", {})[m] = r
            line = f"   fp8 M={m:3d}: bf16 cublas {r['cublas_us']:6.1f} us, bf16 best {r['bf16_best_us']:6.1f}"
            if "fp8_us" in r:
                line += (f"; skinny (tile {r['block_m']}) {tuple(r['best'])} {r['fp8_us']:6.1f} us "
                         f"({r['fp8_frac_bw']:.0%} of copy bw for its bytes), equal to bf16 over its values: "
                         f"{r['equal']}")
            if "gemm_us" in r:
                line += (f"; fp8 gemm {tuple(r['gemm_best'])} {r['gemm_us']:6.1f} us, "
                         f"{2 * m * n * k / r['gemm_us'] * 1e-6:.0f} TFLOP/s, diff {r['gemm_rel_diff']:.1e}")
            print(line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def _bf16_rows(m: int, copies: list[torch.Tensor], tilings: bool = True) -> tuple[torch.Tensor, int, float, dict]:
    """One row count over the bf16 weights: (x [m, K], tile rows, cuBLAS s, {config: s} with one tile of the next
    power-of-two rows; without `tilings`, cuBLAS only: tile rows 0 and no configs)."""
    x = torch.randn(m, copies[0].shape[1], device=copies[0].device, dtype=torch.bfloat16)
    tc = time_per_call(lambda ww: F.linear(x, ww), copies, rounds=10)
    if not tilings:
        return x, 0, tc, {}
    block_m = max(16, triton.next_power_of_2(m))
    return x, block_m, tc, skinny_gemm.time_candidates(x, copies, block_m, rounds=10)


def _fp8_rows(m: int, copies: list[torch.Tensor], bw: float) -> dict:
    """One row count: bf16 cuBLAS and best tiling, then every skinny tiling (up to 64 rows) and every fp8 GEMM tiling
    (from 33 rows) over the weights' fp8 copies; and whether the best skinny tiling's output equals the same
    tiling's over the bf16 values of the fp8 weights (the scaling is exact, but the compiled sums may be ordered
    differently: H200, some tilings equal, others not), and the fp8 GEMM's largest difference from cuBLAS over those
    values, in units of the output's largest magnitude."""
    from engines.kernels.lm import fp8_gemm
    from engines.lm.model.fp8 import dequantize, quantize

    x, block_m, tc, tb = _bf16_rows(m, copies, tilings=m <= 64)
    q = [quantize(w) for w in copies]
    scale = q[0][1]  # one scale for every copy: timing only
    w8s = [w8 for w8, _ in q]
    w8, s0 = q[0]
    out = {"block_m": block_m, "cublas_us": tc * 1e6, "bf16_best_us": min(tb.values(), default=tc) * 1e6}
    if m <= 64:
        t8 = skinny_gemm.time_candidates(x, w8s, block_m, rounds=10, scale=scale)
        best = min(t8, key=t8.__getitem__)
        try:
            equal = torch.equal(skinny_gemm.launch(x, w8, best, block_m=block_m, scale=s0),
                                skinny_gemm.launch(x, dequantize(w8, s0, torch.bfloat16), best, block_m=block_m))
        except Exception:  # the tiling does not fit this GPU's shared memory over the bf16 values (twice the bytes)
            equal = None
        out.update(best=list(best), fp8_us=t8[best] * 1e6, fp8_frac_bw=w8.numel() / t8[best] / bw, equal=equal)
    if m > 32:
        tg = fp8_gemm.time_candidates(x, w8s, scale, rounds=10)
        bg = min(tg, key=tg.__getitem__)
        ref = torch.nn.functional.linear(x, dequantize(w8, s0, torch.bfloat16)).float()
        diff = (fp8_gemm.launch(x, w8, s0, bg).float() - ref).abs().max() / ref.abs().max()
        out.update(gemm_best=list(bg), gemm_us=tg[bg] * 1e6, gemm_rel_diff=float(diff),
                   gemm_all_us={str(c): v * 1e6 for c, v in tg.items()})
    return out


if __name__ == "__main__":
    main()
