"""Runs the full-context estimator's paged attention and page writes in the Triton interpreter on the CPU, in float32
(fp16 queries over fp8 pages in one case; the interpreter's bfloat16 is not faithful; nor is its rounding to fp8, so
fp8 pages are only read here, their writes checked on a GPU), printing one JSON line per case: its largest difference
from what it must give (estimator_pages.py). Run by tests/engines/kernels/test_paged_attention_interpreted.py as
`TRITON_INTERPRET=1 python -m tests.engines.kernels.interpreted_paged CASES_JSON` (the variable must be set before
the kernels are defined: a process of its own)."""

from __future__ import annotations

import json
import sys

import torch

from engines.config import to_cache
from tests.engines.kernels.estimator_pages import max_error, paged_case, write_case


def main(cases: list[dict]) -> None:
    from engines.kernels.speech_out.flow import paged_attention as pa

    for case in cases:
        splits = case.pop("splits")
        pa.num_splits = lambda programs, device, s=splits: s  # (the split count the GPU would choose, given)
        if case.pop("write", False):
            qkv, pages, new_page, want = write_case(**case, dtype=torch.float32, device="cpu")
            pa.write_pages(qkv, pages, new_page)
            err = (pages - want).abs().max().item()
        else:
            fp8 = case.pop("fp8", None)  # None, or the queries' dtype over fp8 pages
            c = paged_case(**case, dtype=torch.float32, device="cpu")
            if fp8:  # pages in fp8, read back into the products' dtype (cache_value.fp16_dots)
                c = c._replace(pages=to_cache(c.pages, torch.float8_e4m3fn), q=c.q.to(getattr(torch, fp8)))
            err = max_error(pa.paged_attention(*c.args()), c)
        print(json.dumps(err), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
