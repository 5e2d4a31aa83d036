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
# An answer of 26 codes in a voice with a tail of 6 (the default voice's: 3): its first job of 3 chunks (the tail and 9
# codes), 3 chunks, a last one of 2 codes.
GRAPHS = {"kind": "graphs", "prompt_codes": 46, "n_codes": 26}


def _run(cases: list[dict]) -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "tests.engines.kernels.interpreted_encoder_attention",
                          json.dumps(cases)], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == len(cases)
    return results


def test_answers_through_the_in_place_encoder_attention_equal_the_whole_sequence():
    for r in _run(CASES):
        assert r["in_place"] > 0 and r["error"] <= TOL, r


def test_the_encoders_graphs_captured_at_load_serve_an_answer_in_another_voice():
    """The encoder's graphs (a stand-in re-running the captured function) captured for the default voice serve an
    answer in a voice of another tail: its first job and its chunks replay them, its last partial chunk runs eagerly,
    nothing is captured while decoding, and the PCM is the eager CPU decoder's (keys gathered)."""
    (r,) = _run([GRAPHS])
    assert r["captured_while_decoding"] == 0 and r["replays"] == 4 and r["error"] <= 1e-5, r
