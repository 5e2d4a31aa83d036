"""Paged attention kernels of the LM (split-KV decode, varlen prefill tiles, fp8 caches) against the float64 torch
path on random batches. Run: python3 -m pytest tests/gpu (needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from engines.lm.model.attention import paged_attention
from tests.gpu.lm_kernel_cases import MIXED_CASES, PRELOAD_LIMITS, make_case, rel_err, torch_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")


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
    tolerance of the query's dtype (bf16 queries: dots in fp16, cache_value.fp16_dots), and no further from it than
    the kernels over a cache holding the same values in the query's dtype (their tilings differ)."""
    from engines.config import to_cache
    from engines.kernels.cache_value import fp16_dots

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
