"""GPU kernels against the torch path on random inputs. Run: python3 -m pytest tests/gpu (needs CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from engines.api import ChannelSampling
from engines.lm.model.attention import paged_attention
from engines.lm.model.batch import ForwardBatch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def make_case(seed: int, block_size: int, q_lens: list[int], ctx_lens: list[int], dtype, heads=32, kvh=8, d=128):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)  # non-contiguous tables
    tables, k = [], 0
    for n in blocks_needed:
        tables.append(perm[k:k + n])
        k += n
    width = max(blocks_needed)
    cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=g).to(dtype).cuda()
    positions, qstart = [], [0]
    for q, c in zip(q_lens, ctx_lens, strict=True):
        positions += list(range(c - q, c))
        qstart.append(qstart[-1] + q)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device="cuda")
    batch = ForwardBatch(
        rows=torch.zeros(len(positions), 2, dtype=torch.long, device="cuda"), positions=as_long(positions),
        slot_mapping=as_long([0] * len(positions)), query_start=as_long(qstart), context_lens=as_long(ctx_lens),
        block_tables=as_long([t + [0] * (width - len(t)) for t in tables]), logits_rows=as_long([]),
        max_query_len=max(q_lens), max_context_len=max(ctx_lens), is_decode=all(q == 1 for q in q_lens),
        num_decode_seqs=next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens)),
        query_start_host=qstart, context_lens_host=ctx_lens)
    q = torch.randn(len(positions), heads, d, generator=g).to(dtype).cuda()
    return q, cache, batch


def torch_reference(q, cache, batch):
    cpu = ForwardBatch(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})
    return paged_attention(q.double().cpu(), cache[0].double().cpu(), cache[1].double().cpu(), cpu)


# The decode kernel's two ways to start: the first tile read after the PDL wait, or before it (where every program
# has an SM of its own; forced on here for every batch).
PRELOAD_LIMITS = pytest.mark.parametrize("preload_limit", [0, 1 << 30], ids=["after-wait", "preload"])


@pytest.fixture
def preload(monkeypatch, preload_limit):
    from engines.kernels.lm import paged_decode

    monkeypatch.setattr(paged_decode, "PRELOAD_MAX_PROGRAMS", preload_limit)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@PRELOAD_LIMITS
def test_decode_kernel_matches_torch(block_size, dtype, bound, preload):
    for seed, ctx in enumerate([[1], [5, 1000, 17, 64], [2048] * 8, [1, 3, 4095, 300, 65, 129]]):
        q, cache, batch = make_case(seed, block_size, [1] * len(ctx), ctx, dtype)
        out = paged_attention(q, cache[0], cache[1], batch)
        assert torch.isfinite(out).all()
        assert rel_err(out, torch_reference(q, cache, batch)) < bound  # bf16 inputs: ~4e-3 expected


@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16])
def test_decode_kernel_every_split_count_matches_torch(splits):
    """The split count falls with the batch (num_splits); every count gives the reference's attention, also with
    contexts shorter than the splits' tiles (empty splits) and one split over a 4095-row context."""
    from engines.kernels.lm.paged_decode import num_splits, paged_decode_attention

    for seed, ctx in enumerate([[1], [5, 1000, 17, 64], [1, 3, 4095, 300, 65, 129]]):
        q, cache, batch = make_case(40 + seed, 16, [1] * len(ctx), ctx, torch.bfloat16)
        out = paged_decode_attention(q, cache[0], cache[1], batch.block_tables, batch.context_lens,
                                     q.shape[-1] ** -0.5, splits=splits)
        assert rel_err(out, torch_reference(q, cache, batch)) < 1e-2
    dev = torch.device("cuda")
    assert num_splits(1, 8, dev) == 16 and num_splits(128, 8, dev) == 1
    assert [num_splits(b, 8, dev) for b in (1, 2, 4, 8, 16, 32, 64, 96, 128)] == sorted(
        (num_splits(b, 8, dev) for b in (1, 2, 4, 8, 16, 32, 64, 96, 128)), reverse=True)


@pytest.mark.parametrize("name", ["TILING", "TILING_MANY_SPLITS", "TILING_WIDE"])
@PRELOAD_LIMITS
def test_every_tiling_of_a_16_bit_cache_matches_torch(monkeypatch, name, preload):
    """Each tiling `tiling` may pick for a bf16 cache, at 1, 4 and 16 splits, gives the reference's attention; the
    pick itself follows the launch (many splits, few programs, many programs, float32)."""
    from engines.kernels.lm import paged_decode

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    wide_fits = paged_decode._shared_memory(dev) >= paged_decode.WIDE_MIN_SHARED_BYTES
    if name == "TILING_WIDE" and not wide_fits:
        pytest.skip(f"128-row bf16 stages need {paged_decode.WIDE_MIN_SHARED_BYTES} bytes of shared memory a block; "
                    f"this GPU offers {paged_decode._shared_memory(dev)}")
    assert paged_decode.tiling(torch.bfloat16, 16, 128, dev) == paged_decode.TILING_MANY_SPLITS
    assert paged_decode.tiling(torch.bfloat16, 4, sms, dev) == (paged_decode.TILING_WIDE if wide_fits
                                                                 else paged_decode.TILING)
    assert paged_decode.tiling(torch.bfloat16, 1, 4 * sms, dev) == paged_decode.TILING
    assert paged_decode.tiling(torch.float32, 1, sms, dev) == paged_decode.TILING
    picked = getattr(paged_decode, name)
    monkeypatch.setattr(paged_decode, "tiling", lambda *args: picked)
    q, cache, batch = make_case(61, 16, [1] * 6, [1, 3, 1500, 300, 65, 129], torch.bfloat16)
    for splits in (1, 4, 16):
        out = paged_decode.paged_decode_attention(q, cache[0], cache[1], batch.block_tables, batch.context_lens,
                                                  q.shape[-1] ** -0.5, splits=splits)
        assert rel_err(out, torch_reference(q, cache, batch)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@PRELOAD_LIMITS
def test_one_split_writes_the_merges_output_itself(monkeypatch, dtype, preload):
    """With one split the split kernel divides by the softmax sum and writes the output: bit-identical to the merge
    kernel over that one split (MERGE_ONE_SPLIT), and the reference's attention."""
    from engines.kernels.lm import paged_decode

    q, cache, batch = make_case(51, 16, [1] * 6, [1, 3, 4095, 300, 65, 129], dtype)
    args = (q, cache[0], cache[1], batch.block_tables, batch.context_lens, q.shape[-1] ** -0.5)
    direct = paged_decode.paged_decode_attention(*args, splits=1)
    monkeypatch.setattr(paged_decode, "MERGE_ONE_SPLIT", True)
    merged = paged_decode.paged_decode_attention(*args, splits=1)
    assert torch.equal(direct, merged)
    assert rel_err(direct, torch_reference(q, cache, batch)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


MIXED_CASES = [([1, 1, 40, 23], [300, 9, 40, 140]),  # decode rows, a fresh prefill, a chunk on a cached prefix
               ([512], [512]),  # one long fresh prefill: 16 tiles
               ([1, 33, 65, 1000], [4000, 1000, 65, 1130])]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_mixed_decode_and_prefill_with_cached_prefix(block_size, dtype, bound):
    """Varlen tile kernel (prefill rows) + split-KV kernel (decode rows) against the float64 torch path."""
    for seed, (q_lens, ctx) in enumerate(MIXED_CASES):
        q, cache, batch = make_case(7 + seed, block_size, q_lens, ctx, dtype)
        out = paged_attention(q, cache[0], cache[1], batch)
        assert rel_err(out, torch_reference(q, cache, batch)) < bound, (q_lens, ctx)


def test_varlen_tiles_padded_as_in_a_cuda_graph():
    """A tile list padded with sequence -1 (as the mixed-step graphs pass it) gives the same rows."""
    from engines.kernels.tiles import tile_map

    q_lens, ctx = [1, 70, 5], [50, 300, 5]
    q, cache, batch = make_case(11, 16, q_lens, ctx, torch.float32)
    batch.tiles = torch.tensor(tile_map(q_lens, 1, num_tiles=9), dtype=torch.long, device="cuda")
    out = paged_attention(q, cache[0], cache[1], batch)
    assert rel_err(out, torch_reference(q, cache, batch)) < 1e-5


def test_decode_and_varlen_kernels_gqa_group_of_tiny_model():
    for q_lens, ctx in (([1, 1, 1], [33, 1, 250]), ([1, 40], [33, 90])):
        q, cache, batch = make_case(3, 16, q_lens, ctx, torch.float32, heads=4, kvh=2, d=16)
        out = paged_attention(q, cache[0], cache[1], batch)
        assert rel_err(out, torch_reference(q, cache, batch)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@PRELOAD_LIMITS
def test_attention_over_an_fp8_cache_is_attention_over_its_values(dtype, preload):
    """The decode and varlen kernels over an fp8 cache: the float64 attention over the cache's values within the
    tolerance of the query's dtype (bf16 queries: dots in fp16, paged_decode.fp16_dots), and no further from it than
    the kernels over a cache holding the same values in the query's dtype (their tilings differ)."""
    from engines.kernels.lm.paged_decode import fp16_dots
    from engines.lm.model.attention import to_cache

    # 1-6 sequences run FP8_TILING_MANY_SPLITS, 24 sequences FP8_TILING
    cases = [([1], [1]), ([1] * 4, [5, 1000, 17, 64]), ([1] * 6, [1, 3, 4095, 300, 65, 129]),
             ([1] * 24, [7 + 97 * i for i in range(24)]), *MIXED_CASES]
    for seed, (q_lens, ctx) in enumerate(cases):
        q, cache, batch = make_case(70 + seed, 16, q_lens, ctx, torch.float32)
        fp8 = to_cache(cache * 4, torch.float8_e4m3fn)  # [2, blocks, page, kvh, d]
        same = fp8.to(dtype)
        q = q.to(dtype)
        assert fp16_dots(q, fp8[0]) is (dtype == torch.bfloat16)
        out = paged_attention(q, fp8[0], fp8[1], batch)
        plain = paged_attention(q, same[0], same[1], batch)
        want = torch_reference(q, same, batch)
        bound = 1e-2 if dtype == torch.bfloat16 else 1e-5
        err = rel_err(out, want)
        assert err < bound and err <= 1.5 * rel_err(plain, want) + bound / 10, (q_lens, ctx, err)


def _torch_rmsnorm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rmsnorm_matches_torch(dtype):
    from engines.kernels.lm.fused import add_rmsnorm

    g = torch.Generator(device="cuda").manual_seed(0)
    for t, n in [(1, 4096), (37, 4096), (5, 64)]:
        x = torch.randn(t, n, device="cuda", generator=g).to(dtype)
        r = torch.randn(t, n, device="cuda", generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
        out, res = add_rmsnorm(x, r, w, 1e-6)
        assert torch.equal(res, x + r)
        assert rel_err(out, _torch_rmsnorm(x + r, w, 1e-6)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
        out0, _ = add_rmsnorm(x, None, w, 1e-6)
        assert rel_err(out0, _torch_rmsnorm(x, w, 1e-6)) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("block_size", [1, 16])
def test_fused_qk_norm_rope_kv_write_matches_torch(block_size):
    from engines.kernels.lm.fused import qk_norm_rope_write_kv
    from engines.lm.model.attention import write_kv
    from engines.lm.model.rope import apply_rope, rope_cos_sin, rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(1)
    t, h, kvh, d, dtype = 19, 32, 8, 128, torch.bfloat16
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", generator=g).to(dtype)
    qw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    pos = torch.randint(0, 5000, (t,), device="cuda", generator=g)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(d, 1e6).cuda(), dtype)
    slots = torch.randperm(64 * block_size, device="cuda", generator=g)[:t]
    caches = [torch.full((64, block_size, kvh, d), float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
    q = qk_norm_rope_write_kv(qkv, qw, kw, cos, sin, caches[0], caches[1], slots, h, kvh, 1e-6)
    q_ref, k_ref, v_ref = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q_ref = apply_rope(_torch_rmsnorm(q_ref.reshape(t, h, d), qw, 1e-6), cos, sin)
    k_ref = apply_rope(_torch_rmsnorm(k_ref.reshape(t, kvh, d), kw, 1e-6), cos, sin)
    write_kv(k_ref, v_ref.reshape(t, kvh, d), caches[2], caches[3], slots)
    assert rel_err(q, q_ref) < 1e-2
    written = caches[0].view(-1, kvh, d)[slots]
    assert torch.isfinite(written).all()
    assert rel_err(written, caches[2].view(-1, kvh, d)[slots]) < 1e-2
    assert torch.equal(caches[1].view(-1, kvh, d)[slots], caches[3].view(-1, kvh, d)[slots])


def test_fused_write_into_an_fp8_cache_stores_the_torch_paths_values():
    """Keys (normed and rotated, rounded to bf16 first) and values into an fp8 cache: the bf16 cache's values cast
    as engines.lm.model.attention.to_cache casts them, saturated beyond +-448, bit for bit."""
    from engines.kernels.lm.fused import qk_norm_rope_write_kv
    from engines.lm.model.attention import to_cache
    from engines.lm.model.rope import rope_cos_sin, rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(2)
    t, h, kvh, d, dtype = 37, 32, 8, 128, torch.bfloat16
    qkv = torch.randn(t, (h + 2 * kvh) * d, device="cuda", generator=g).to(dtype)
    qkv[:, (h + kvh) * d:] *= 300  # values beyond e4m3's range
    qw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    kw = (300 * torch.randn(d, device="cuda", generator=g)).to(dtype)  # keys over e4m3's range too
    pos = torch.randint(0, 5000, (t,), device="cuda", generator=g)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(d, 1e6).cuda(), dtype)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:t]
    plain = [torch.zeros(64, 16, kvh, d, device="cuda", dtype=dtype) for _ in range(2)]
    fp8 = [torch.zeros(64, 16, kvh, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2)]
    q = qk_norm_rope_write_kv(qkv, qw, kw, cos, sin, plain[0], plain[1], slots, h, kvh, 1e-6)
    q8 = qk_norm_rope_write_kv(qkv, qw, kw, cos, sin, fp8[0], fp8[1], slots, h, kvh, 1e-6)
    assert torch.equal(q, q8)
    for a, b in zip(plain, fp8, strict=True):
        rows = a.view(-1, kvh, d)[slots]
        assert rows.abs().max() > 448
        got, want = b.view(-1, kvh, d)[slots].float(), to_cache(rows, torch.float8_e4m3fn).float()
        bad = (got != want).nonzero()[:4].tolist()
        assert not bad, [(rows[tuple(i)].item(), got[tuple(i)].item(), want[tuple(i)].item()) for i in bad]


def test_fused_silu_mul_matches_torch():
    from engines.kernels.lm.fused import silu_mul

    g = torch.Generator(device="cuda").manual_seed(2)
    gu = torch.randn(7, 2 * 12288, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = gu.split(12288, dim=-1)
    assert rel_err(silu_mul(gu), torch.nn.functional.silu(gate) * up) < 1e-2


def launch_tiling(*args, launch=None, **kwargs) -> torch.Tensor | None:
    """skinny_gemm.launch (or `launch`, another kernel's), or None for a tiling too large for this GPU (the tuners
    skip those too)."""
    from engines.kernels.lm import skinny_gemm

    try:
        return (launch or skinny_gemm.launch)(*args, **kwargs)
    except Exception as e:
        if "OutOfResources" in type(e).__name__ or "out of resource" in str(e):
            return None
        raise


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


@pytest.mark.parametrize("channel", [0, 1])
def test_race_noise_kernel_is_bit_identical_to_torch(channel):
    from engines.kernels.lm.sampling import race_noise
    from engines.lm.sampler import exponential_noise, row_keys

    g = torch.Generator(device="cuda").manual_seed(5)
    for b, k in [(1, 50), (7, 16512), (3, 1)]:
        seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda", generator=g)
        steps = torch.randint(0, 10_000, (b,), device="cuda", generator=g)
        ids = torch.randint(0, 151680, (b, k), device="cuda", generator=g)
        ref = exponential_noise(row_keys(seeds, steps, channel), ids)
        got = race_noise(seeds, steps, channel, ids)
        assert torch.isfinite(got).all()
        assert torch.equal(got, ref)
        # and against the CPU path, which the CPU tests pin
        assert torch.allclose(got.cpu(), exponential_noise(row_keys(seeds.cpu(), steps.cpu(), channel), ids.cpu()),
                              rtol=1e-6, atol=0)


@pytest.mark.parametrize("width", [16512, 151680, 5000])
def test_two_stage_top_k_equals_torch_topk(width):
    """The sampler's staged top-k (slices of 128, then the candidates) == torch.topk: same sorted values, and
    indices that hold those values; with masked (-inf) tails as the audio channel has, and a width that needs
    padding (5000)."""
    from engines.lm.sampler import top_k

    g = torch.Generator(device="cuda").manual_seed(9)
    for rows, k in [(1, 20), (5, 1), (3, 64)]:
        x = torch.randn(rows, width, device="cuda", generator=g) * 3
        x[:, width - width // 100:] = float("-inf")
        vals, idx = top_k(x, k)
        ref_vals, ref_idx = torch.topk(x, k, dim=-1)
        assert torch.equal(vals, ref_vals)
        assert torch.equal(torch.gather(x, 1, idx), vals)
        assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)  # no ties among random floats
    few = torch.full((2, width), float("-inf"), device="cuda")
    few[:, 7] = 1.0  # fewer finite entries than k: the rest are -inf at real (in-range) indices
    vals, idx = top_k(few, 20)
    assert vals[:, 0].eq(1.0).all() and idx[:, 0].eq(7).all() and torch.isinf(vals[:, 1:]).all()
    assert int(idx.max()) < width


@pytest.mark.parametrize("vocab,audio", [(16512, True), (151680, False), (3000, False)])
def test_fused_top_k_sampler_draws_the_torch_paths_tokens(vocab, audio):
    """engines/kernels/lm/topk_sample.py against the torch sampler (mask, penalty over a slot's history, temperature,
    top-k, top-p, noise race, greedy) on random rows with per-row parameters: the same token in every row. Both
    paths draw with the same counter-based noise, so only last-bit differences of softmax/cumsum could make them
    differ, and these rows have none. The logits are left intact."""
    from engines.kernels.lm import topk_sample
    from engines.lm.sampler import (
        AUDIO_CHANNEL,
        TEXT_CHANNEL,
        ChannelTensors,
        mask_audio_logits,
        sample_channel,
        sample_rows,
    )

    g = torch.Generator(device="cuda").manual_seed(11)
    channel = AUDIO_CHANNEL if audio else TEXT_CHANNEL
    for b, max_k in [(1, 20), (9, 64), (33, 1), (64, 32)]:
        logits = torch.randn(b, vocab, device="cuda", generator=g) * 4
        seen = torch.rand(80, vocab, device="cuda", generator=g) < 0.05
        slots = torch.randperm(80, device="cuda", generator=g)[:b]
        ks = torch.randint(1, max_k + 1, (b,), device="cuda", generator=g)
        ks[0] = max_k
        t = ChannelTensors(
            temperature=torch.rand(b, device="cuda", generator=g) * 1.5 + 0.1,
            top_p=torch.where(torch.rand(b, device="cuda", generator=g) < 0.3, 1.0,
                              torch.rand(b, device="cuda", generator=g) * 0.9 + 0.05),
            top_k=ks, penalty=torch.rand(b, device="cuda", generator=g) + 0.8,
            greedy=torch.rand(b, device="cuda", generator=g) < 0.25, max_top_k=max_k)
        seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda", generator=g)
        steps = torch.randint(0, 50, (b,), device="cuda", generator=g)
        min_new = torch.randint(0, 50, (b,), device="cuda", generator=g) if audio else None
        if audio:  # end of speech is the best logit in every row: gated where steps < min_new
            logits[:, 16384] = 60.0
            logits[:, 16385:] = 90.0  # never drawn
        before = logits.clone()
        assert topk_sample.supported(logits, max_k)
        got = sample_rows(logits, seen, slots, t, seeds, steps, channel, min_new)
        assert torch.equal(logits, before)
        masked = mask_audio_logits(logits.clone(), steps, min_new) if audio else logits
        ref = sample_channel(masked, seen[slots], t, seeds, steps, channel)  # sample_rows' torch path
        assert torch.equal(got, ref), (b, max_k, (got != ref).nonzero().flatten().tolist())
        if audio:
            assert int(got.max()) <= 16384
            gated = steps < min_new
            assert not got[gated].eq(16384).any() and got[~gated & t.greedy].eq(16384).all()


def test_fused_top_k_sampler_compiles_once_for_every_batch_and_column_offset():
    """The per-row columns are views into the step's staged upload at offsets that move with the batch size: after
    the first call, no batch size or offset compiles another kernel (a compile while serving stalls every session;
    a 12-session load test once waited 2.1 s for one)."""
    from engines.kernels.lm import topk_sample

    def compiled() -> int:
        return sum(len(c[0]) for k in (topk_sample._candidates_kernel, topk_sample._pick_kernel)
                   for c in k.device_caches.values())

    g = torch.Generator(device="cuda").manual_seed(12)
    vocab = 16512
    seen = torch.zeros(80, vocab, dtype=torch.bool, device="cuda")
    words = torch.zeros(4096, dtype=torch.long, device="cuda")  # int columns, packed as the staged upload packs them
    floats = torch.ones(4096, dtype=torch.float32, device="cuda")
    counts = []
    for b in (1, 2, 3, 5, 8, 12, 13):
        for shift in (0, 1, 3):  # every column starts at another word offset
            cols = [words[shift + i * b: shift + (i + 1) * b] for i in range(5)]  # slots, top_k, greedy, seeds, steps
            slots, top_k, greedy, seeds, steps = cols
            slots.copy_(torch.arange(b))
            top_k.fill_(20)
            temp, top_p, penalty = (floats[shift + i * b: shift + (i + 1) * b] for i in range(3))
            pairs = torch.zeros(b, 2, dtype=torch.long, device="cuda")
            logits = torch.randn(b, vocab, device="cuda", generator=g)
            topk_sample.topk_sample(logits, seen, slots, temp, top_p, top_k, penalty, greedy, seeds, steps, 1, 20,
                                    out=pairs[:, 1])
            assert pairs[:, 1].lt(vocab).all()
            counts.append(compiled())
    assert counts[0] >= 2 and len(set(counts)) == 1, counts


def test_fused_top_k_sampler_greedy_ties_pick_the_lowest_id():
    """Equal best logits: greedy takes the lowest id (torch.argmax's rule), also across the kernel's slices."""
    from engines.lm.sampler import ChannelTensors, sample_rows

    logits = torch.full((2, 16512), -5.0, device="cuda")
    logits[0, [9000, 70, 4000]] = 3.0
    logits[1, [16000, 1100]] = 3.0
    t = ChannelTensors.build([ChannelSampling(top_k=20)] * 2, [True, True], torch.device("cuda"))
    seen = torch.zeros(2, 16512, dtype=torch.bool, device="cuda")
    got = sample_rows(logits, seen, torch.arange(2, device="cuda"), t, torch.zeros(2, dtype=torch.long, device="cuda"),
                      torch.zeros(2, dtype=torch.long, device="cuda"), 0)
    assert got.tolist() == [70, 1100]


def full_size_layers(rows: int, n: int = 4):
    """`n` full-size decoder layers with random weights over a decode batch of `rows` sequences (contexts of
    1-1500 rows): (layers, x [rows, hidden], per-layer caches, the initial cache, the batch, forward() -> the last
    layer's output). The GEMM shapes are tuned, then forced to their best Triton tiling with one pass over K (the
    one gate_up's SiLU*up epilogue needs), whatever the tuner chose."""
    from engines.config import model_config_for
    from engines.kernels.lm import skinny_gemm
    from engines.lm.model.layers import DecoderLayer
    from engines.lm.model.rope import rope_cos_sin, rope_inv_freq

    mc = model_config_for("full-random")
    g = torch.Generator(device="cuda").manual_seed(11)
    layers = [DecoderLayer(mc, "cuda", torch.bfloat16) for _ in range(n)]
    for layer in layers:
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, device="cuda", generator=g) * (0.02 if p.dim() == 2 else 1.0) + (
                1.0 if p.dim() == 1 else 0.0))
    ctx = [700, 1, 1500, 33, 1024, 5, 900, 64][:rows] + [1] * max(0, rows - 8)
    q, cache, batch = make_case(13, 16, [1] * rows, ctx, torch.bfloat16, heads=mc.num_attention_heads,
                                kvh=mc.num_key_value_heads, d=mc.head_dim)
    kv = [cache.clone() for _ in layers]
    batch.slot_mapping.copy_(batch.block_tables[torch.arange(rows), (batch.context_lens - 1) // 16] * 16
                             + (batch.context_lens - 1) % 16)
    positions = batch.context_lens - 1
    cos, sin = rope_cos_sin(positions, rope_inv_freq(mc.head_dim, mc.rope_theta).cuda(), torch.bfloat16)
    x = torch.randn(rows, mc.hidden_size, device="cuda", generator=g).to(torch.bfloat16)

    def forward():
        h, r = x, None
        for layer, c in zip(layers, kv, strict=True):
            h, r = layer(h, r, cos, sin, c, batch)
        return h + r

    l0 = layers[0]  # tune the GEMM shapes outside any capture
    for lin in (l0.qkv_proj, l0.o_proj, l0.gate_up_proj, l0.down_proj):
        skinny_gemm.tune(lin.weight)
        key = (*lin.weight.shape, torch.bfloat16, skinny_gemm.MAX_ROWS)
        t = skinny_gemm.timings[key]
        skinny_gemm._choice[key] = min(
            (c for c in t if c != "cublas" and c[4] == 1), key=t.__getitem__)
    return layers, x, kv, cache, batch, forward


@PRELOAD_LIMITS
def test_pdl_decoder_layers_in_a_graph_equal_without_pdl(preload):
    """Four full-size decoder layers (skinny GEMMs, fused norms, decode attention, all launched
    with programmatic dependent launch) captured in one CUDA graph give the same bits as the same graph without
    PDL, replay after replay with fresh inputs. The graph pool reuses buffers between layers, so a kernel that
    wrote before its predecessor finished reading (or read before it finished writing) would show up here."""
    from engines.kernels import pdl
    from engines.lm.step_graphs import capture_graph, private_stream

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper (sm_90) or later")
    layers, x, kv, cache, batch, forward = full_size_layers(rows=3)
    g = torch.Generator(device="cuda").manual_seed(12)
    dev = torch.cuda.current_device()
    saved = pdl._enabled.get(dev)
    outs = {}
    try:
        for on in (False, True):
            pdl._enabled[dev] = on
            graph, out = capture_graph(forward, private_stream())
            outs[on] = (graph, out)
    finally:
        if saved is None:
            pdl._enabled.pop(dev, None)
        else:
            pdl._enabled[dev] = saved
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16))
        results = {}
        for on, (graph, out) in outs.items():
            for c, c0 in zip(kv, [cache] * len(kv), strict=True):
                c.copy_(c0)  # the same cache before each graph (both write the new row's K/V)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            results[on] = (out.clone(), [c.clone() for c in kv])
        assert torch.isfinite(results[True][0]).all()
        assert torch.equal(results[True][0], results[False][0])
        for a, b in zip(results[True][1], results[False][1], strict=True):
            assert torch.equal(a, b)


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


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_decoder_layers_with_the_glu_epilogue_equal_the_separate_kernels(rows, monkeypatch):
    """Four full-size layers at decode sizes with SiLU*up in gate_up's epilogue give the bits (outputs and K/V
    written) of the same layers with the separate SiLU*up kernel (what a layer runs where the epilogue cannot)."""
    from engines.kernels.lm import skinny_gemm

    layers, x, kv, cache, batch, forward = full_size_layers(rows)
    assert skinny_gemm.glu(x, layers[0].gate_up_proj.weight) is not None  # the epilogue runs in these layers
    outs = {}
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(skinny_gemm, "glu", lambda *a, **k: None)
        for c in kv:
            c.copy_(cache)
        outs[fuse] = (forward(), [c.clone() for c in kv])
    (fused, kv_fused), (plain, kv_plain) = outs[True], outs[False]
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    for a, b in zip(kv_fused, kv_plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed_rope_kernel_equals_embed_and_rope_cos_sin(dtype):
    """The step's first kernel gives the bits of MossSpeechModel.embed and rope_cos_sin: audio rows (text id
    modality_pad) look up their audio id, text rows their text id whatever audio id they carry, and cos/sin of
    positions up to the model's longest."""
    from engines.config import model_config_for
    from engines.kernels.lm.fused import embed_rope
    from engines.lm.model.moss import MossSpeechModel
    from engines.lm.model.rope import rope_cos_sin
    from engines.tokens import MODALITY_PAD

    model = MossSpeechModel(model_config_for("tiny-random"), device="cuda", dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(31)
    for emb in (model.embed_tokens, model.audio_embed):
        emb.weight.data.copy_(torch.randn(emb.weight.shape, device="cuda", generator=g))
    t = 300
    text = torch.randint(0, model.config.vocab_size, (t,), device="cuda", generator=g)
    text[::3] = MODALITY_PAD
    rows = torch.stack([text, torch.randint(0, model.config.audio_vocab_size, (t,), device="cuda", generator=g)], 1)
    positions = torch.randint(0, 8192, (t,), device="cuda", generator=g)
    positions[:4] = torch.tensor([0, 1, 4095, 8191])
    x, cos, sin = embed_rope(rows, positions, model.embed_tokens.weight, model.audio_embed.weight, model.inv_freq,
                             MODALITY_PAD)
    ref_cos, ref_sin = rope_cos_sin(positions, model.inv_freq, dtype)
    assert torch.equal(x, model.embed(rows))
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


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


@pytest.mark.parametrize("rows", [2, 24])
def test_decoder_layers_over_fp8_copies_match_the_same_layers_over_their_values(rows):
    """Four full-size layers with fp8 copies (the GLU epilogue included) against the same layers reading the bf16
    values of those copies, in a CUDA graph as the engine runs them: the same up to the GEMMs' summation order."""
    from engines.lm.model import fp8
    from engines.lm.step_graphs import capture_graph, private_stream

    layers, x, kv, cache, batch, forward = full_size_layers(rows)
    linears = [lin for layer in layers for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    for lin in linears:
        lin.fp8 = fp8.round_weight(lin.weight.data)
    outs = {}
    for on in (True, False):
        copies = [lin.fp8 for lin in linears]
        if not on:
            for lin in linears:
                lin.fp8 = None
        for c in kv:
            c.copy_(cache)
        forward()  # eager first: tunes the fp8 shapes outside the capture
        graph, out = capture_graph(forward, private_stream())
        for c in kv:
            c.copy_(cache)
        graph.replay()
        torch.cuda.synchronize()
        outs[on] = out.clone()
        for lin, cp in zip(linears, copies, strict=True):
            lin.fp8 = cp
    assert torch.isfinite(outs[True]).all()
    assert rel_err(outs[True], outs[False]) < 2e-2


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
