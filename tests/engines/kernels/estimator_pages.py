"""Cases for the full-context estimator's paged attention (engines/kernels/speech_out/flow/paged_attention.py) and
what they must give: the row's pages gathered and read through SDPA under the chunk mask, as the CPU path of
engines/speech_out/flow/cached_estimator.py does. Used by the GPU tests and the Triton interpreter's CPU run."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FR, H, D = 20, 8, 64  # frames a page, heads, head width: the full-size estimator's


class PagedCase(NamedTuple):
    q: torch.Tensor  # [2B, F, H * D] (a view, as the q/k/v split gives)
    pages: torch.Tensor  # [2 kv, 2 branch, pages, FR, H * D]
    table: torch.Tensor  # [B, maxp + c]
    n_keys: torch.Tensor  # [B]
    n_new: torch.Tensor  # [B]
    real: torch.Tensor  # [F] bool: the query frames that are not padding

    def args(self) -> tuple:
        """paged_attention's arguments."""
        return self.q, self.pages, self.table, self.n_keys, self.n_new, H, FR


def paged_case(B: int, c: int, hist: list[int], maxp: int, last: int, dtype: torch.dtype = torch.bfloat16,
               device: str = "cuda", seed: int = 0) -> PagedCase:
    """B rows of c new chunks (the last with `last` real frames), row b after hist[b] earlier pages anywhere in the
    pool, its table padded to maxp with page 0."""
    g = torch.Generator().manual_seed(seed)
    n_pages = max(300, maxp + 1)
    rows = []
    for h in hist:
        got = torch.randint(1, n_pages, (h + c,), generator=g).tolist()
        rows.append(got[:h] + [0] * (maxp - h) + got[h:])
    pages = torch.randn(2, 2, n_pages, FR, H * D, generator=g).to(device, dtype)
    q = torch.randn(2 * B, c * FR, 3, H * D, generator=g).to(device, dtype).unbind(2)[0]
    return PagedCase(q, pages, torch.tensor(rows, device=device, dtype=torch.long),
                     torch.tensor([h * FR for h in hist], device=device), torch.full((B,), (c - 1) * FR + last,
                                                                                    device=device),
                     torch.arange(c * FR, device=device) < (c - 1) * FR + last)


def reference(case: PagedCase) -> torch.Tensor:
    """[2B, F, H * D] float32: each row's gathered pages through SDPA under the chunk mask."""
    q, pages, table, n_keys, n_new = case.q, case.pages, case.table, case.n_keys, case.n_new
    R, Fq, HD = q.shape
    slots = table.shape[1]
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


def max_error(got: torch.Tensor, case: PagedCase) -> float:
    """The largest difference from the reference over real query frames (padded ones are never read)."""
    return (got.float() - reference(case))[:, case.real].abs().max().item()


def write_case(B: int, c: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0):
    """(qkv [2B, F, 3 * H * D], pages [2, 2, 64, FR, H * D], new_page [B, c]) and the pages as the CPU path's indexed
    copy leaves them."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(2, 2, 64, FR, H * D, generator=g).to(device, dtype)
    new_page = (torch.randperm(63, generator=g)[:B * c].view(B, c) + 1).to(device)
    qkv = torch.randn(2 * B, c * FR, 3 * H * D, generator=g).to(device, dtype)
    want = pages.clone()
    want[:, :, new_page] = page_layout(qkv, B, c)
    return qkv, pages, new_page, want


def page_layout(qkv: torch.Tensor, B: int, c: int) -> torch.Tensor:
    """The keys and values of qkv [2B, c * FR, 3 * H * D] as their pages hold them: [2 kv, 2 branch, B, c, FR,
    H * D]."""
    return qkv.unflatten(2, (3, H * D))[:, :, 1:].permute(2, 0, 1, 3).unflatten(1, (2, B)).unflatten(3, (c, FR))
