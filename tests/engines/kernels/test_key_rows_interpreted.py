"""The full-context flow's encoder-key launches (engines/kernels/speech_out/flow/key_rows.py) run in the Triton
interpreter on the CPU: gathered rows are each answer's voice keys, then its own, then zeros; appended rows land after
each answer's own and nowhere else (float32; on a GPU the full-context tests run them: tests/gpu/
test_full_context_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.paths import REPO

CASES = [
    # voices of different lengths (one none), answers of different lengths (one none yet), blocks of rows crossed
    {"kind": "gather", "voices": [5, 0, 7], "own": [3, 30, 0], "length": 40},
    {"kind": "gather", "voices": [0], "own": [0], "length": 3},  # nothing held: zeros only
    # a first job's several chunks (more rows than a block), and one chunk
    {"kind": "append", "own": [0, 12, 40], "m": 20},
    {"kind": "append", "own": [7, 0], "m": 5},
]


def test_the_key_row_launches_in_the_interpreter_give_the_concatenated_keys():
    run = subprocess.run([sys.executable, "-m", "tests.engines.kernels.interpreted_key_rows", json.dumps(CASES)],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = [json.loads(line) for line in run.stdout.splitlines()]
    assert errors == [0.0] * len(CASES), errors
