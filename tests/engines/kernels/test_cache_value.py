"""How kernels read a key/value cache (engines/kernels/cache_value.py), checked on the CPU: which caches the word
reader may read, and the dtype of the products over each (the word reader itself runs in the interpreter:
test_paged_attention_interpreted.py, and on a GPU: tests/gpu/test_paged_estimator_attention_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from engines.kernels.cache_value import check_word_aligned, fp16_dots


def test_an_fp8_cache_is_read_as_words_only_where_its_rows_start_on_4_bytes():
    pages = torch.zeros(2, 2, 3, 20, 512, dtype=torch.float8_e4m3fn)
    check_word_aligned(pages, pages.stride()[:4], 64)  # the served layout
    odd = torch.zeros(2, 2, 3, 20, 514, dtype=torch.float8_e4m3fn)[..., :512]  # rows 514 bytes apart
    with pytest.raises(ValueError, match="32-bit words"):
        check_word_aligned(odd, odd.stride()[:4], 64)
    with pytest.raises(ValueError, match="head size 6"):
        check_word_aligned(pages, pages.stride()[:4], 6)
    shifted = pages.view(-1)[1:]  # data one byte in
    with pytest.raises(ValueError):
        check_word_aligned(shifted, (4,), 64)
    bf16 = torch.zeros(2, 2, 3, 20, 514, dtype=torch.bfloat16)[..., :511]
    check_word_aligned(bf16, bf16.stride()[:4], 7)  # 16-bit caches are read as values: any layout


def test_products_run_in_fp16_over_fp8_under_16_bit_queries():
    fp8 = torch.zeros(1, dtype=torch.float8_e4m3fn)
    assert fp16_dots(torch.zeros(1, dtype=torch.bfloat16), fp8)
    assert not fp16_dots(torch.zeros(1, dtype=torch.float32), fp8)
    assert not fp16_dots(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16))
