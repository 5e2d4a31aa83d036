"""The full-context estimator's paged attention kernels (engines/kernels/speech_out/flow/paged_attention.py) run in
the Triton interpreter on the CPU: their indexing, masks and key splits give the gathered-pages reference (float32;
the GPU tests check bfloat16: tests/gpu/test_paged_estimator_attention_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.paths import REPO

CASES = [
    {"B": 1, "c": 1, "hist": [14], "maxp": 16, "last": 20, "splits": 3},  # one row, its keys split and merged
    {"B": 3, "c": 2, "hist": [0, 5, 40], "maxp": 60, "last": 11, "splits": 1},  # first jobs, a partial last chunk
    {"B": 4, "c": 1, "hist": [3, 20, 0, 14], "maxp": 250, "last": 20, "splits": 2},  # a graph's wide table
    # a voice's prompt in one pass: new frames in several blocks, a split starting among them, an empty split
    {"B": 2, "c": 4, "hist": [5, 0], "maxp": 8, "last": 20, "splits": 2},
    # an fp8 cache under fp16 queries: the products run in fp16; under float32 ones, in float32
    {"B": 3, "c": 2, "hist": [0, 5, 40], "maxp": 60, "last": 11, "splits": 2, "fp8": "float16", "tol": 2e-3},
    {"B": 3, "c": 2, "hist": [0, 5, 40], "maxp": 60, "last": 11, "splits": 2, "fp8": "float32"},
    {"B": 3, "c": 2, "write": True, "splits": 1},  # the new chunks' keys and values to their pages
]


def test_the_paged_attention_kernels_in_the_interpreter_give_the_gathered_pages_reference():
    cases = [{k: v for k, v in c.items() if k != "tol"} for c in CASES]
    run = subprocess.run([sys.executable, "-m", "tests.engines.kernels.interpreted_paged", json.dumps(cases)],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(errors) == len(CASES), errors
    assert all(e < c.get("tol", 1e-4) for e, c in zip(errors, CASES, strict=True)), errors
