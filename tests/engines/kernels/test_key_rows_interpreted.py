"""The full-context flow's encoder-key append (engines/kernels/speech_out/flow/key_rows.py) run in the Triton
interpreter on the CPU: appended rows land after each answer's own and nowhere else (float32; on a GPU the
full-context tests run it: tests/gpu/test_full_context_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.paths import REPO

CASES = [
    # a first job's several chunks (more rows than a block), and one chunk
    {"own": [0, 12, 40], "m": 20},
    {"own": [7, 0], "m": 5},
]


def test_the_key_append_launch_in_the_interpreter_gives_the_concatenated_keys():
    run = subprocess.run([sys.executable, "-m", "tests.engines.kernels.interpreted_key_rows", json.dumps(CASES)],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = [json.loads(line) for line in run.stdout.splitlines()]
    assert errors == [0.0] * len(CASES), errors
