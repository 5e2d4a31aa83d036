"""The LM's GEMM kernels (skinny GEMM over bf16 and fp8 weights, its GLU epilogue, the fp8 GEMM) against F.linear,
and their tuners and tuning file. Run: python3 -m pytest tests/gpu (needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.lm_kernel_cases import launch_tiling, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_gemm_every_tiling_matches_f_linear(dtype):
    from engines.kernels.lm import skinny_gemm

    g = torch.Generator(device="cuda").manual_seed(3)
    # (N, K, M): a model shape with one row, then ragged N and K (masked tails) with several rows. Each tiling
    # runs two cases (compiles are slow); fp16 checks two tilings.
    cases = [(4096, 4096, 1), (200, 2048, 16), (200, 1000, 3)]
    configs = skinny_gemm.CANDIDATES if dtype == torch.bfloat16 else skinny_gemm.CANDIDATES[-2:]
    checked = 0
    for i, cfg in enumerate(configs):
        for n, k, m in (cases[i % 3], cases[(i + 1) % 3]):
            if cfg[4] > 1 and k % (cfg[4] * cfg[1]):
                continue  # split-K needs whole K blocks per split; the tuner skips it the same way
            w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
            x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
            ref = torch.nn.functional.linear(x.float(), w.float())
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # poisoned
            if launch_tiling(x, w, cfg, out) is None:
                continue
            assert torch.isfinite(out).all(), (n, k, m, cfg)
            assert rel_err(out, ref) < 1e-2, (n, k, m, cfg)  # bf16 output rounding: ~3e-3 expected
            checked += 1
    assert checked >= len(configs)


@pytest.mark.parametrize("m,block_m", [(24, 32), (64, 64), (40, 64)])
def test_skinny_gemm_tiles_of_more_rows_match_f_linear(m, block_m):
    """`launch(block_m=)` (the benchmark's rows past MAX_ROWS: `skinny_gemm --wide`), ragged N and K included."""
    g = torch.Generator(device="cuda").manual_seed(4)
    checked = 0
    for n, k in ((4096, 4096), (200, 1000)):
        w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float())
        for cfg in ((32, 128, 4, 6, 1), (64, 128, 4, 4, 1)):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
            if launch_tiling(x, w, cfg, out, block_m=block_m) is None:
                continue
            assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2, (n, k, m, cfg)
            checked += 1
    assert checked >= 2


def test_skinny_gemm_tuned_linear_replays_in_a_cuda_graph():
    from engines.kernels.lm import skinny_gemm

    g = torch.Generator(device="cuda").manual_seed(4)
    w = torch.randn(6144, 4096, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(4, 4096, device="cuda", generator=g).to(torch.bfloat16)
    skinny_gemm.tune(w)
    key = (6144, 4096, torch.bfloat16, skinny_gemm.MAX_ROWS)
    assert "cublas" in skinny_gemm.timings[key] and key in skinny_gemm._choice
    cfg = skinny_gemm.timings[key]  # force the kernel into the graph whatever the tuner chose
    cfg = min((c for c in cfg if c != "cublas"), key=cfg.__getitem__)
    skinny_gemm.launch(x, w, cfg)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = skinny_gemm.launch(x, w, cfg)
        out_linear = skinny_gemm.linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn(4, 4096, device="cuda", generator=g).to(torch.bfloat16))  # fresh inputs each replay
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.nn.functional.linear(x.float(), w.float())
        assert rel_err(out, ref) < 1e-2
        assert rel_err(out_linear, ref) < 1e-2


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_skinny_gemm_glu_epilogue_equals_silu_mul_after_the_gemm(rows):
    """gate_up's SiLU*up in the GEMM's epilogue gives the bits of the separate kernel after the plain GEMM, for
    every one-pass tiling, and matches the float64 reference within bf16 rounding."""
    from engines.kernels.lm import skinny_gemm
    from engines.kernels.lm.fused import silu_mul

    g = torch.Generator(device="cuda").manual_seed(21)
    bf = torch.bfloat16
    f = 3072  # gate_up of a smaller MLP: 2F x hidden
    w = (torch.randn(2 * f, 4096, device="cuda", generator=g) * 0.02).to(bf)
    x = torch.randn(rows, 4096, device="cuda", generator=g).to(bf)
    gate, up = torch.nn.functional.linear(x.double(), w.double()).split(f, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    checked = 0
    for cfg in skinny_gemm.CANDIDATES:
        if cfg[4] > 1:
            continue
        got = launch_tiling(x, w, cfg, glu=True)
        if got is None:
            continue
        assert got.shape == (rows, f)
        assert torch.equal(got, silu_mul(skinny_gemm.launch(x, w, cfg))), cfg
        assert rel_err(got, ref) < 1e-2, cfg
        checked += 1
    assert checked >= 10
    with pytest.raises(ValueError, match="one-pass"):
        skinny_gemm.launch(x, w, (32, 256, 4, 4, 2), glu=True)
    with pytest.raises(ValueError, match="columns"):
        skinny_gemm.launch(x[:, :1000], w, (32, 256, 4, 4, 1), glu=True)


@pytest.mark.parametrize("m,block_m", [(1, 16), (7, 16), (16, 16), (24, 32), (32, 32)])
def test_skinny_gemm_over_an_fp8_weight_matches_f_linear_over_its_values(m, block_m):
    """Every fp8 tiling (split-K and the GLU epilogue included), ragged N and K, against F.linear over the exact
    bf16 values of the fp8 weight (engines/lm/model/fp8.py); outputs poisoned first."""
    from engines.kernels.lm import skinny_gemm
    from engines.kernels.lm.fused import silu_mul
    from engines.lm.model.fp8 import dequantize, quantize

    g = torch.Generator(device="cuda").manual_seed(31)
    checked = glu_checked = tried = 0
    for i, (n, k) in enumerate(((4096, 4096), (200, 1000))):
        w8, scale = quantize(torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
                             * torch.logspace(-3, 0, n, device="cuda")[:, None].to(torch.bfloat16))
        values = dequantize(w8, scale, torch.bfloat16)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.double(), values.double())
        gate, up = ref.split(n // 2, dim=-1)
        ref_glu = torch.nn.functional.silu(gate) * up
        for cfg in skinny_gemm.FP8_CANDIDATES[i::2]:  # half the tilings per shape: every tiling runs once
            if cfg[4] > 1 and k % (cfg[4] * cfg[1]):
                continue
            tried += 1
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            if launch_tiling(x, w8, cfg, out, block_m=block_m, scale=scale) is None:
                continue  # too large for this GPU's shared memory (the tuner skips it too)
            assert torch.isfinite(out).all(), (n, k, cfg)
            assert rel_err(out, ref) < 1e-2, (n, k, cfg, rel_err(out, ref))
            checked += 1
            if cfg[4] == 1:
                got = skinny_gemm.launch(x, w8, cfg, glu=True, block_m=block_m, scale=scale)
                assert torch.equal(got, silu_mul(out)), (n, k, cfg)
                assert rel_err(got, ref_glu) < 1e-2, (n, k, cfg, rel_err(got, ref_glu))
                glu_checked += 1
    assert tried >= 16 and checked >= tried - 2 and glu_checked >= 8, (tried, checked, glu_checked)
    with pytest.raises(ValueError, match="needs row scales"):
        skinny_gemm.launch(x, w8, (32, 256, 4, 4, 1))
    with pytest.raises(ValueError, match="takes no row scales"):
        skinny_gemm.launch(x, values, (32, 256, 4, 4, 1), scale=scale)


def test_linear_with_only_its_fp8_copy_matches_its_values_at_every_row_count():
    """fp8_copies.apply(keep_weights=False) drops a Linear's weight: decode-sized rows read the copy through the
    skinny kernel, more rows through the fp8 GEMM (both tuned by fp8_copies.tune_kernels), and all of them equal
    F.linear over the rounded values up to summation order. A float32 input takes the dequantized values (no kernel for
    it)."""
    from engines.lm.model import fp8, fp8_copies
    from engines.lm.model.layers import Linear

    g = torch.Generator(device="cuda").manual_seed(32)
    lin = Linear(6144, 4096, "cuda", torch.bfloat16)
    lin.weight.data.copy_(torch.randn(6144, 4096, device="cuda", generator=g) * 0.02)
    holder = torch.nn.Module()
    holder.lin = lin
    holder.dtype = torch.bfloat16
    values = fp8.dequantize(*fp8.quantize(lin.weight.data), torch.bfloat16)
    assert fp8_copies.apply(holder, keep_weights=False) == 6144 * 4096 + 6144 * 4 and lin.weight is None
    # skinny tiles of 16 and 32 rows; buckets 64-512 (300 -> 512)
    assert fp8_copies.tune_kernels(holder, 300, 8) == 2 + 4
    assert fp8_copies.tune_kernels(holder, 20, 20) == 2  # 17-20 rows run the 32-row tile: tuned too
    for m in (1, 9, 16, 17, fp8.MAX_ROWS, fp8.MAX_ROWS + 1, 64, 65, 300):
        x = torch.randn(m, 4096, device="cuda", generator=g).to(torch.bfloat16)
        assert rel_err(lin(x), torch.nn.functional.linear(x.double(), values.double())) < 1e-2, m
    x = torch.randn(3, 4096, device="cuda", generator=g)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, values.float()))


@pytest.mark.parametrize("m", [33, 100, 300])
def test_fp8_gemm_matches_f_linear_over_the_weight_values(m):
    """Every fp8 GEMM tiling (both operand orders, split-K), ragged N and K, rows past the skinny kernel's tiles,
    against F.linear over the exact bf16 values of the fp8 weight; outputs poisoned first."""
    from engines.kernels.lm import fp8_gemm
    from engines.lm.model.fp8 import dequantize, quantize

    g = torch.Generator(device="cuda").manual_seed(33)
    checked = tried = 0
    for n, k in ((4096, 4096), (200, 1000)):
        w8, scale = quantize(torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
                             * torch.logspace(-3, 0, n, device="cuda")[:, None].to(torch.bfloat16))
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.double(), dequantize(w8, scale, torch.bfloat16).double())
        for cfg in fp8_gemm.CANDIDATES:
            if cfg[6] > 1 and k % (cfg[6] * cfg[2]):
                continue
            tried += 1
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            if launch_tiling(x, w8, scale, cfg, out, launch=fp8_gemm.launch) is None:
                continue  # too large for this GPU's shared memory (the tuner skips it too)
            assert torch.isfinite(out).all(), (n, k, cfg)
            assert rel_err(out, ref) < 1e-2, (n, k, cfg, rel_err(out, ref))
            checked += 1
    assert tried > len(fp8_gemm.CANDIDATES) and checked >= tried - 4, (tried, checked)
    with pytest.raises(ValueError, match="e4m3 weight"):
        fp8_gemm.launch(x, dequantize(w8, scale, torch.bfloat16), scale, fp8_gemm.DEFAULT)


def test_tuners_skip_the_tilings_a_launch_refuses_or_this_gpu_cannot_run():
    """gemm_common.time_tilings, behind both tuners: at K = 1000 every split-K tiling is refused by its launch (the
    split does not divide K) and is left out; the one-pass tilings that fit are timed."""
    from engines.kernels.lm import fp8_gemm, skinny_gemm
    from engines.lm.model.fp8 import quantize

    g = torch.Generator(device="cuda").manual_seed(34)
    w = torch.randn(200, 1000, device="cuda", generator=g).to(torch.bfloat16)
    w8, scale = quantize(w)
    for got, cands, split_at in (
            (skinny_gemm.time_candidates(torch.randn(4, 1000, device="cuda").to(torch.bfloat16), [w], rounds=1),
             skinny_gemm.CANDIDATES, 4),
            (fp8_gemm.time_candidates(torch.randn(40, 1000, device="cuda").to(torch.bfloat16), [w8], scale, rounds=1),
             fp8_gemm.CANDIDATES, 6)):
        assert got and all(c[split_at] == 1 for c in got), got
        assert set(got) <= {c for c in cands if c[split_at] == 1}
        assert all(t > 0 for t in got.values())


def test_tuned_tilings_are_kept_in_the_tuning_file_and_taken_from_it(tmp_path, monkeypatch):
    """MOSS_TUNING_FILE: the first tuning of an fp8 weight's skinny tile and fp8 GEMM bucket is written to the file
    under this GPU's name; a later start (the tuners' memory cleared, the tuners made to fail) takes the tilings from
    it, and they run and give F.linear over the weight's values."""
    import json

    from engines.kernels import tuning as tuning_file
    from engines.kernels.lm import fp8_gemm, skinny_gemm
    from engines.lm.model import fp8

    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning_file.ENV, str(path))
    monkeypatch.setattr(skinny_gemm, "_choice", {})
    monkeypatch.setattr(fp8_gemm, "_choice", {})
    g = torch.Generator(device="cuda").manual_seed(33)
    w8, scale = fp8.quantize(torch.randn(2048, 1024, device="cuda", generator=g).to(torch.bfloat16) * 0.02)
    first = (skinny_gemm.config_for(w8, scale, torch.bfloat16, 16), fp8_gemm.config_for(w8, scale, 64, torch.bfloat16))
    stored = json.loads(path.read_text())["gpus"][torch.cuda.get_device_name()]
    assert set(stored) == {"skinny 2048 1024 torch.float8_e4m3fn 16", "fp8_gemm 2048 1024 64"}

    def no_tuning(*a, **k):
        raise AssertionError("tuned although the file holds this shape")

    monkeypatch.setattr(skinny_gemm, "_choice", {})
    monkeypatch.setattr(fp8_gemm, "_choice", {})
    monkeypatch.setattr(skinny_gemm, "tune", no_tuning)
    monkeypatch.setattr(fp8_gemm, "tune", no_tuning)
    assert (skinny_gemm.config_for(w8, scale, torch.bfloat16, 16),
            fp8_gemm.config_for(w8, scale, 64, torch.bfloat16)) == first
    values = fp8.dequantize(w8, scale, torch.bfloat16).double()
    for m, run in ((5, lambda x: skinny_gemm.launch(x, w8, first[0], scale=scale)),
                   (64, lambda x: fp8_gemm.linear(x, w8, scale))):
        x = torch.randn(m, 1024, device="cuda", generator=g).to(torch.bfloat16)
        assert rel_err(run(x), torch.nn.functional.linear(x.double(), values)) < 1e-2


def test_the_shipped_tuning_picks_are_tilings_the_tuners_offer():
    """engines/kernels/tunings.json: every pick one its tuner offers now (a candidate list that changed would drop the
    pick at every start, with a warning)."""
    from engines.kernels import tuning as tuning_file
    from engines.kernels.lm import fp8_gemm, skinny_gemm

    for gpu, section in tuning_file._read(tuning_file.SHIPPED)["gpus"].items():
        for name, pick in section.items():
            value = tuning_file.decoded(pick)
            kind = name.split()[0]
            # a skinny key names the weight's dtype: a tile over an fp8 copy, or over a bf16 weight (cuBLAS offered)
            offered = fp8_gemm.CANDIDATES if kind == "fp8_gemm" else skinny_gemm.offered(fp8="float8" in name)
            assert value in offered, (gpu, name, pick)
