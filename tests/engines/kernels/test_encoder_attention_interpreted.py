"""The full-context flow's encoder attention reading each answer's earlier keys where they are (the CUDA path,
engines/kernels/speech_out/flow/encoder_attention.py) run in the Triton interpreter on the CPU: answers streamed
through it equal the chunk model over the whole sequence, alone and batched with answers at other points and in
other voices, first jobs of several chunks included (float32; on a GPU tests/gpu/test_full_context_gpu.py runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.paths import REPO

# the whole-sequence tolerance of tests/engines/speech_out/flow/test_full_context.py
TOL = 1e-5
CASES = [
    # one chunk without a prompt; a long answer after a prompt (keys across many blocks of the launch)
    {"specs": [[0, 5, 1]], "first": False},
    {"specs": [[23, 61, 2]], "first": False},
    # first jobs of several chunks (the chunk mask among the new keys), answers joining a round apart in voices of
    # other lengths (one without a prompt)
    {"specs": [[23, 17, 3], [0, 23, 4], [17, 31, 5]], "first": True},
]


def test_answers_through_the_in_place_encoder_attention_equal_the_whole_sequence():
    run = subprocess.run([sys.executable, "-m", "tests.engines.kernels.interpreted_encoder_attention",
                          json.dumps(CASES)], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(CASES)
    for r in results:
        assert r["in_place"] > 0 and r["error"] <= TOL, results
