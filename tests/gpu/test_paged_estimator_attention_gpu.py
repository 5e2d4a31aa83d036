"""CUDA-only: the full-context estimator's attention reading its pages in place equals the gathered pages through
SDPA under the chunk mask (the CPU path), for one chunk and for a first job's several, tables padded to a bucket,
last chunks padded to whole ones or far wider than any row (a graph's), batches of one row (key splits merged) and of
many, pages in bf16 or fp8; and the new chunks' keys and values are written to their pages as the indexed copy of the
CPU path writes them (to fp8 pages rounded and saturated as `to_cache` rounds them, bit for bit).
Run on a GPU machine: `pytest tests/gpu/test_paged_estimator_attention_gpu.py`. On CPU-only CI every test here is
skipped with the reason below (the CPU path: tests/engines/speech_out/flow/test_full_context.py; the kernels' logic
in the Triton interpreter: tests/engines/kernels/test_paged_attention_interpreted.py)."""

from __future__ import annotations

import pytest
import torch

from engines.config import to_cache
from tests.engines.kernels.estimator_pages import max_error, page_layout, paged_case, write_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a Triton kernel); the CPU "
                                "path is covered by tests/engines/speech_out/flow/test_full_context.py")


@pytest.mark.parametrize(("B", "c", "hist", "maxp", "last"), [
    (1, 1, [14], 16, 20),  # one row: key splits, merged
    (1, 1, [0], 0, 20),  # nothing earlier
    (5, 1, [14, 30, 0, 63, 7], 64, 20),  # rows at other points, the table padded to a bucket
    (3, 1, [14, 2, 40], 48, 9),  # a last chunk padded to a whole one
    (4, 2, [14, 14, 3, 0], 16, 20),  # first jobs of two chunks
    (2, 3, [14, 20], 32, 13),  # three chunks, the last one partial
    (1, 70, [0], 0, 20),  # a voice's whole prompt in one pass
    (32, 1, [50] * 32, 64, 20),  # a large batch: one split
    (1, 1, [3], 250, 20),  # a graph's table (the pool's width) far wider than the row: most splits empty
    (3, 2, [0, 5, 120], 250, 11),  # rows of very different lengths in one wide table
])
def test_paged_attention_equals_the_gathered_pages_through_sdpa(B, c, hist, maxp, last):
    from engines.kernels.speech_out.flow.paged_attention import paged_attention

    case = paged_case(B, c, hist, maxp, last, seed=B * 100 + c)
    err = max_error(paged_attention(*case.args()), case)
    assert err < 2e-2, err


@pytest.mark.parametrize(("B", "c"), [(1, 1), (5, 1), (3, 2), (2, 3)])
def test_write_pages_puts_the_new_keys_and_values_where_the_indexed_copy_does(B, c):
    from engines.kernels.speech_out.flow.paged_attention import write_pages

    qkv, pages, new_page, want = write_case(B, c, seed=B * 10 + c)
    write_pages(qkv, pages, new_page)
    assert torch.equal(pages, want)


@pytest.mark.parametrize(("B", "c", "hist", "maxp", "last"), [
    (1, 1, [14], 16, 20), (5, 1, [14, 30, 0, 63, 7], 64, 20), (3, 2, [0, 5, 120], 250, 11), (64, 1, [42] * 64, 64, 20)])
def test_paged_attention_reads_fp8_pages_as_the_gathered_fp8_pages_give(B, c, hist, maxp, last):
    from engines.kernels.speech_out.flow.paged_attention import paged_attention

    case = paged_case(B, c, hist, maxp, last, seed=B * 100 + c)
    case = case._replace(pages=to_cache(case.pages, torch.float8_e4m3fn))
    err = max_error(paged_attention(*case.args()), case)
    assert err < 2e-2, err


@pytest.mark.parametrize(("B", "c"), [(1, 1), (3, 2)])
def test_write_pages_rounds_to_fp8_pages_as_to_cache_does(B, c):
    from engines.kernels.speech_out.flow.paged_attention import write_pages

    qkv, pages, new_page, _ = write_case(B, c, seed=B * 10 + c)
    qkv = qkv * 200  # some keys and values past +-448: saturated
    pages = to_cache(pages, torch.float8_e4m3fn)
    want = pages.clone()
    want.view(torch.uint8)[:, :, new_page] = to_cache(page_layout(qkv, B, c), torch.float8_e4m3fn).view(torch.uint8)
    write_pages(qkv, pages, new_page)
    assert torch.equal(pages.view(torch.uint8), want.view(torch.uint8))
    assert pages.float().abs().max() == 448
