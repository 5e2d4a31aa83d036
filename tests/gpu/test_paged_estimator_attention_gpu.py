"""CUDA-only: the full-context estimator's attention reading its pages in place equals the gathered pages through
SDPA under the chunk mask (the CPU path), for one chunk and for a first job's several, tables padded to a bucket,
last chunks padded to whole ones or far wider than any row (a graph's), batches of one row (key splits merged) and of
many; and the new chunks' keys and values are written to their pages as the indexed copy of the CPU path writes them.
Run on a GPU machine: `pytest tests/gpu/test_paged_estimator_attention_gpu.py`. On CPU-only CI every test here is
skipped with the reason below (the CPU path: tests/engines/speech_out/flow/test_full_context.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a Triton kernel); the CPU "
                                "path is covered by tests/engines/speech_out/flow/test_full_context.py")

FR, H, D = 20, 8, 64


def _reference(q, pages, table, n_keys, n_new):
    """The gather + SDPA path of engines/speech_out/flow/cached_estimator.py, written out."""
    R, Fq, HD = q.shape
    B, slots = table.shape
    c = Fq // FR
    maxp = slots - c
    got = pages[:, :, table].reshape(2, R, slots * FR, HD).float()  # rows branch-major
    i = torch.arange(slots * FR, device=q.device)
    j = i - maxp * FR
    q_chunk = torch.arange(Fq, device=q.device) // FR
    new = (j >= 0)[None, None] & (j[None, None] < n_new[:, None, None]) \
        & ((j // FR)[None, None] <= q_chunk[None, :, None])
    ok = (i[None, None] < n_keys[:, None, None]) | new  # [B, F, L]
    mask = ok.repeat(2, 1, 1)[:, None]

    def heads(t):
        return t.view(R, t.shape[1], H, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(heads(q.float()), heads(got[0]), heads(got[1]), attn_mask=mask)
    return o.transpose(1, 2).reshape(R, Fq, HD)


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

    torch.manual_seed(B * 100 + c)
    dev, dt = torch.device("cuda"), torch.bfloat16
    n_pages = 300
    pages = torch.randn(2, 2, n_pages, FR, H * D, device=dev, dtype=dt)
    rows = []
    for h in hist:  # pages anywhere in the pool (rows may share some, as answers in one voice do); padding reads 0
        got = torch.randint(1, n_pages, (h + c,)).tolist()
        rows.append(got[:h] + [0] * (maxp - h) + got[h:])
    table = torch.tensor(rows, device=dev, dtype=torch.long)
    n_keys = torch.tensor([h * FR for h in hist], device=dev)
    n_new = torch.full((B,), (c - 1) * FR + last, device=dev)
    q = torch.randn(2 * B, c * FR, 3, H * D, device=dev, dtype=dt).unbind(2)[0]  # a view, as the q/k/v split gives
    got = paged_attention(q, pages, table, n_keys, n_new, H, FR).float()
    want = _reference(q, pages, table, n_keys, n_new)
    real = torch.arange(c * FR, device=dev) < (c - 1) * FR + last  # padded query frames are never read
    err = (got - want)[:, real].abs().max().item()
    assert err < 2e-2, err


@pytest.mark.parametrize(("B", "c"), [(1, 1), (5, 1), (3, 2), (2, 3)])
def test_write_pages_puts_the_new_keys_and_values_where_the_indexed_copy_does(B, c):
    from engines.kernels.speech_out.flow.paged_attention import write_pages

    torch.manual_seed(B * 10 + c)
    dev, dt = torch.device("cuda"), torch.bfloat16
    pages = torch.randn(2, 2, 64, FR, H * D, device=dev, dtype=dt)
    want = pages.clone()
    new_page = torch.randperm(63, device=dev)[:B * c].view(B, c) + 1
    qkv = torch.randn(2 * B, c * FR, 3 * H * D, device=dev, dtype=dt)
    write_pages(qkv, pages, new_page)
    kv = qkv.unflatten(2, (3, H * D))[:, :, 1:].permute(2, 0, 1, 3).unflatten(1, (2, B)).unflatten(3, (c, FR))
    want[:, :, new_page] = kv  # (cached_estimator.py's CPU path)
    assert torch.equal(pages, want)
