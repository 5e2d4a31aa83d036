"""Tile sweeps for the codec estimator's kernels: `python3 -m engines.bench.conv_tiles` on a GPU.

Times `_causal_conv_kernel` and `_ln_linear_kernel` per tile configuration inside a CUDA graph (as the Euler solve
runs them) for the estimator's shapes at streaming batch sizes, against the torch path they replace (cuDNN's conv1d;
add_layernorm + cuBLAS GEMM + GELU). `--gemm ROWS` times the estimator's four GEMMs at playing-round sizes on cuBLAS
against the conv kernel's flat loop as a kernel-1 conv (a plain pipelined GEMM) per tiling. `--flat ROWS` sweeps the
tilings of the conv's FLAT loop (one pipelined loop over the whole (tap, channel) reduction, served for the playing
rounds' row counts) against the served conv and the per-tap loop (which restarts its pipeline at every tap), and
checks their outputs.
A development tool for choosing their tiles, not the server.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
import triton

from engines.codec.decoder.estimator import conv_weight_gemm
from engines.kernels.codec_fused import (
    ConvTiling,
    _conv_tiling,
    _ln_linear_kernel,
    add_layernorm,
    causal_conv,
    conv_block_k,
    launch_causal_conv,
)


def _graph_us(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (5 * reps)


def _sweep_configs(configs, time_one) -> list[tuple[float, tuple]]:
    """(us, config) for each config that runs, fastest first; `time_one(config)` times one. A config that does not
    fit (the SM's shared memory or registers) or fails its check is reported and left out."""
    res = []
    for c in configs:
        try:
            res.append((time_one(c), c))
        except Exception as e:  # noqa: BLE001
            print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
    return sorted(res)


def _fastest(res: list[tuple[float, tuple]], n: int = 4) -> str:
    """The n fastest of `res` (us, tiling), fastest first; the empty tiling is cuBLAS."""
    return ", ".join(f"{us:.2f} us {c or 'cuBLAS'}" for us, c in res[:n])


def _conv_inputs(rows: int, cin: int, k: int, cout: int, T: int = 40, w_scale: float = 1.0):
    """bf16 conv operands: x [rows // T, cin, T] in time-major memory (as in the estimator), the weight
    [cout, cin, k] times w_scale, its implicit-GEMM form, and a bias [cout]."""
    dt = torch.bfloat16
    x = torch.randn(rows // T, T, cin, device="cuda", dtype=dt).transpose(1, 2)
    w = torch.randn(cout, cin, k, device="cuda", dtype=dt) * w_scale
    b = torch.randn(cout, device="cuda", dtype=dt)
    return x, w, conv_weight_gemm(w), b


CONFIGS = list(itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4,), (2, 3)))  # BM, BN, BK, warps, stages


def _sweep(rows: int, cin: int, k: int, cout: int = 256, T: int = 40) -> None:
    x, w, wg, b = _conv_inputs(rows, cin, k, cout, T)
    xc = x.contiguous()
    ref = _graph_us(lambda: F.conv1d(xc, w, b, padding=k - 1))
    res = _sweep_configs([c for c in CONFIGS if c[2] <= cin], lambda c: _graph_us(
        functools.partial(launch_causal_conv, x, wg, b, k, ConvTiling(*c))))
    best = _fastest(res)
    print(f"rows {rows:5d} cin {cin} k {k}: cudnn conv1d (NCW, excl. transforms) {ref:.2f} us; best: {best}",
          flush=True)


def _sweep_ln_linear(rows: int, n: int, gelu: bool, c: int = 256) -> None:
    dt = torch.bfloat16
    x, r = (torch.randn(rows, c, device="cuda", dtype=dt) for _ in range(2))
    lw, lb = torch.ones(c, device="cuda", dtype=dt), torch.zeros(c, device="cuda", dtype=dt)
    w = torch.randn(n, c, device="cuda", dtype=dt)
    wt, bias = w.t().contiguous(), torch.zeros(n, device="cuda", dtype=dt)
    y, s = torch.empty(rows, n, device="cuda", dtype=dt), torch.empty_like(x)

    def torch_path():
        h, _ = add_layernorm(x[None], r[None], lw, lb, 1e-5)
        o = F.linear(h, w, bias)
        return F.gelu(o) if gelu else o

    ref = _graph_us(torch_path)

    def run(bm, bn, nw, ns):
        grid = (triton.cdiv(rows, bm), triton.cdiv(n, bn))
        _ln_linear_kernel[grid](x, r, lw, lb, wt, bias, y, s, rows, n, 1e-5, C=c, BLOCK_M=bm, BLOCK_N=bn,
                                HAS_RES=True, HAS_BIAS=True, GELU=gelu, IEEE=False, num_warps=nw, num_stages=ns,
                                PDL=False)

    res = _sweep_configs(itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (1,)),
                         lambda c: _graph_us(functools.partial(run, *c)))
    best = _fastest(res)
    print(f"ln_linear rows {rows:5d} n {n} gelu {gelu}: torch path {ref:.2f} us; best (BM, BN, warps, stages): {best}",
          flush=True)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): wgmma-sized tiles (the per-tap loop ran (32, 128), 4 warps, 2 stages per
# tap at these rows before the flat loop was served); 128 x 256 only with 8 warps (its float32 accumulator alone is 256
# registers a thread at 4)
FLAT_CONFIGS = [c for c in itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4))
                if c[0] * c[1] < 128 * 256 or c[3] == 8]


def _sweep_flat(rows: int, cin: int, k: int, cout: int, T: int = 40) -> None:
    """The served conv, the per-tap loop at the tiling served before the flat loop ((32, 128), 2 stages), the flat
    loop per FLAT_CONFIGS and the per-tap loop at the flat loop's best tiling, same inputs; each result checked
    against the served one (float32 sums of the same products; other tiles group them otherwise)."""
    x, _, wg, b = _conv_inputs(rows, cin, k, cout, T, w_scale=(k * cin) ** -0.5)
    want = causal_conv(x, wg, b, k)
    served = _graph_us(lambda: causal_conv(x, wg, b, k))

    def timed(tiling: ConvTiling) -> float:
        got = launch_causal_conv(x, wg, b, k, tiling)
        err = float((got.float() - want.float()).abs().max())
        if err > 2e-2 * float(want.float().abs().max()):
            raise AssertionError(f"conv {tiling} at {rows} rows differs from the served one by {err}")
        return _graph_us(functools.partial(launch_causal_conv, x, wg, b, k, tiling))

    before = timed(ConvTiling(32, 128, conv_block_k(cin)))
    res = _sweep_configs([c for c in FLAT_CONFIGS if cin % c[2] == 0], lambda c: timed(ConvTiling(*c, flat=True)))
    best = _fastest(res)
    per_tap = timed(ConvTiling(*res[0][1], flat=False))
    print(f"rows {rows:5d} cin {cin} cout {cout} k {k}: served {_conv_tiling(rows, cin, 2)} {served:.2f} us, per-tap "
          f"(32, 128) {before:.2f} us; flat best (BM, BN, BK, warps, stages): {best}; per-tap loop at the best flat "
          f"tiling {per_tap:.2f} us", flush=True)


# The estimator's GEMMs as (K, N, bias): q/k/v (one weight, no bias), to_out, ff.net.0, ff.net.2
ESTIMATOR_GEMMS = ((256, 1536, False), (512, 256, True), (256, 1024, True), (1024, 256, True))
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for the kernel-1 conv: wgmma tiles, 3-4 stages; 128 x 256 only with 8 warps
GEMM_CONFIGS = [c for c in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4))
                if (c[0] * c[1] < 128 * 256 or c[3] == 8) and not (c[2] == 128 and c[4] == 4)]


def kernel1_gemm(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor, tiling: ConvTiling) -> torch.Tensor:
    """x [M, K] @ w_t [K, N] + bias -> [M, N] on _causal_conv_kernel: a conv of kernel 1 over one sequence of M rows
    (its output rows are written [M, N] row-major)."""
    return launch_causal_conv(x.t()[None], w_t, bias, 1, tiling)[0].t()


def _sweep_gemm(rows: int, k: int, n: int, has_bias: bool) -> list[tuple[float, tuple]]:
    """cuBLAS (F.linear, as the estimator runs it above LINEAR_MAX_ROWS / LN_LINEAR_MAX_ROWS rows) against
    kernel1_gemm per GEMM_CONFIGS, same inputs; each result checked against cuBLAS's. Returns (us, config) sorted,
    with cuBLAS as config ()."""
    dt = torch.bfloat16
    x = torch.randn(rows, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dt) if has_bias else None
    w_t, zero = w.t().contiguous(), torch.zeros(n, device="cuda", dtype=dt)
    want = F.linear(x, w, b).float()
    cublas = _graph_us(lambda: F.linear(x, w, b))

    def timed(c: tuple) -> float:
        tiling = ConvTiling(*c, flat=True)
        got = kernel1_gemm(x, w_t, b if has_bias else zero, tiling).float()
        err = float((got - want).abs().max())
        if err > 2e-2 * float(want.abs().max()):
            raise AssertionError(f"kernel-1 conv {c} at {rows} rows differs from cuBLAS by {err}")
        return _graph_us(functools.partial(kernel1_gemm, x, w_t, b if has_bias else zero, tiling))

    res = sorted([(cublas, ()), *_sweep_configs([c for c in GEMM_CONFIGS if c[1] <= n and k % c[2] == 0], timed)])
    best = _fastest(res, 5)
    print(f"gemm rows {rows:5d} K {k:4d} N {n:4d}: cuBLAS {cublas:.2f} us; best (BM, BN, BK, warps, stages): {best}",
          flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flat", default="", help="only the flat conv against the served one at these row counts "
                   "(comma separated, multiples of 40), e.g. 1280,2560,5120")
    p.add_argument("--gemm", default="", help="only the estimator's GEMMs, cuBLAS against the kernel-1 conv, at these "
                   "row counts (comma separated), e.g. 1280,2560,5120")
    a = p.parse_args()
    if a.gemm:
        for rows in (int(r) for r in a.gemm.split(",")):
            totals: dict[tuple, list[float]] = {}
            for k, n, has_bias in ESTIMATOR_GEMMS:
                for us, c in _sweep_gemm(rows, k, n, has_bias):
                    totals.setdefault(c, []).append(us)
            # one tiling for all four (a served tiling would be one): the smallest sum among those that ran every shape
            whole = sorted((sum(t), c) for c, t in totals.items() if c and len(t) == len(ESTIMATOR_GEMMS))
            print(f"gemm rows {rows:5d}: the four on cuBLAS {sum(totals[()]):.2f} us; one tiling for all: "
                  + ", ".join(f"{us:.2f} us {c}" for us, c in whole[:4]), flush=True)
        return
    if a.flat:
        # the estimator's convs: block1 | res_conv (Cin 320 / 256 / 512 -> 2 x 256: the first and the up resnet
        # here), block2 and the down / up / final convs (256 -> 256), all kernel 3
        for rows in (int(r) for r in a.flat.split(",")):
            for cin, cout, k in ((320, 512, 3), (512, 512, 3), (256, 256, 3)):
                _sweep_flat(rows, cin, k, cout)
        return
    for rows, (n, gelu) in itertools.product((80, 320, 640, 1280, 2560), ((1536, False), (1024, True))):
        _sweep_ln_linear(rows, n, gelu)
    for rows, cin in itertools.product((80, 320, 1280, 2560), (320, 256, 512)):
        _sweep(rows, cin, 3)
    for rows in (80, 1280):
        _sweep(rows, 256, 1)


if __name__ == "__main__":
    main()
