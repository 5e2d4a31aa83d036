"""Runs the full-context flow with its encoder's attention reading each answer's keys in place
(engines/kernels/speech_out/flow/encoder_attention.py, the CUDA path) in the Triton interpreter on the CPU, printing
one JSON line per case: the largest difference of its answers' mel from the chunk model over the whole sequence
(`reference.py`). Run by tests/engines/kernels/test_encoder_attention_interpreted.py as `TRITON_INTERPRET=1 python -m
tests.engines.kernels.interpreted_encoder_attention CASES_JSON` (a process of its own: the variable must be set before
the kernels are defined)."""

from __future__ import annotations

import json
import sys

import torch

from engines.speech_out import CodecDecoder
from engines.speech_out.flow.conformer import key_factors
from engines.speech_out.flow.full_context import FullContextFlow
from tests.engines.speech_out.decoder_rounds import random_position_biases
from tests.engines.speech_out.flow.full_answers import Answer, decode_in_rounds, voice_inputs


def answers_case(fc: FullContextFlow, specs: list[list[int]], first: bool) -> float:
    """Answers (prompt codes, answer codes, seed) decoded together, joining a round apart; `first`: each one's first
    job is its voice's tail and its first codes up to a chunk boundary, several chunks in one call."""
    flow, answers = fc.flow, []
    for P, N, seed in specs:
        pcodes, pmel, xv = voice_inputs(P, seed)
        codes = torch.randint(0, 16384, (N,), generator=torch.Generator().manual_seed(seed + 1))
        answers.append((Answer(fc, fc.prepare_voice(pcodes, pmel, xv), codes.tolist(), seed), pcodes, pmel, codes))
    decode_in_rounds(fc, [a for a, *_ in answers], first)
    err = 0.0
    for a, pcodes, pmel, codes in answers:
        err = max(err, float((torch.cat(a.mel, 1) - a.reference(flow, pcodes, pmel, codes)).abs().max()))
        fc.close(a.state)
        fc.forget_voice(a.voice)
    fc.pages.check()
    return err


def _counted(fn, calls: list):
    def counted(*a):
        calls.append(1)
        return fn(*a)
    return counted


def main(cases: list[dict]) -> None:
    torch.manual_seed(0)
    flow = CodecDecoder.load("tiny-random", vocoder="hift", context="window").flow
    random_position_biases(flow)
    for case in cases:
        fc = FullContextFlow(flow, 400)
        fc.factors = key_factors(torch.arange(1024), flow.cfg.d_model, flow.dtype)  # the CUDA path's table
        calls = []
        fc._encode_rows = _counted(fc._encode_rows, calls)
        err = answers_case(fc, **case)
        print(json.dumps({"error": err, "in_place": len(calls)}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
