"""Runs the encoder keys' appending launch (engines/kernels/speech_out/flow/key_rows.py) in the Triton
interpreter on the CPU, printing one JSON line per case: its largest difference from what it must give (the keys
concatenated by torch). Run by tests/engines/kernels/test_key_rows_interpreted.py as `TRITON_INTERPRET=1 python -m
tests.engines.kernels.interpreted_key_rows CASES_JSON` (a process of its own: the variable must be set before the
kernels are defined)."""

from __future__ import annotations

import json
import sys

import torch

from engines.speech_out.flow.state import GrowingKeys, append_table

LAYERS, HEADS, DK = 3, 3, 4  # a row of 12 values: not a power of two, so the column mask is exercised


def _own(n: int, spare: int, g: torch.Generator) -> GrowingKeys:
    """An answer's buffer of n keys with `spare` rows of garbage after them."""
    keys = GrowingKeys(torch.zeros(LAYERS, 2, 0, HEADS, DK))
    keys.reserve(n + spare)
    keys.buf.normal_(generator=g)
    keys.n = n
    return keys


def append_case(own: list[int], m: int, g: torch.Generator) -> float:
    from engines.kernels.speech_out.flow.key_rows import append_rows

    os_ = [_own(n, m, g) for n in own]
    before = [o.buf.clone() for o in os_]
    new = torch.randn(len(own), LAYERS, 2, m, HEADS, DK, generator=g)
    append_rows(new.flatten(4), torch.from_numpy(append_table(os_)))
    err = 0.0
    for b, (o, was) in enumerate(zip(os_, before, strict=True)):
        want = was.clone()
        want[:, :, o.n:o.n + m] = new[b]  # the new keys after those held; nothing else touched
        err = max(err, float((o.buf - want).abs().max()))
    return err


def main(cases: list[dict]) -> None:
    g = torch.Generator().manual_seed(0)
    for case in cases:
        print(json.dumps(append_case(**case, g=g)), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
