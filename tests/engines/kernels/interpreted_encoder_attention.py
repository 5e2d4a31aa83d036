"""Runs the full-context flow with its encoder's attention reading each answer's keys in place
(engines/kernels/speech_out/flow/encoder_attention.py, the CUDA path) in the Triton interpreter on the CPU, printing
one JSON line per case: the largest difference of its answers' mel from the chunk model over the whole sequence
(`reference.py`); or (kind "graphs") of a decoder whose encoder replays graphs (a stand-in that re-runs the captured
function, graph_stand_in.py) from the eager decoder's PCM, with the graphs captured while decoding. Run by
tests/engines/kernels/test_encoder_attention_interpreted.py as `TRITON_INTERPRET=1 python -m
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


def graphs_case(prompt_codes: int, n_codes: int) -> dict:
    """An answer of n_codes in a voice of prompt_codes, by a decoder whose graphs were captured at load for the default
    voice (a tail of 3) at batches up to 2, against the eager CPU decoder (its keys gathered)."""
    import pytest

    from engines.speech_out import CodecDecoder, Voice
    from tests.engines.speech_out.graph_stand_in import replay_stand_in

    with pytest.MonkeyPatch.context() as mp:
        replay_stand_in(mp)
        dec = CodecDecoder.load("tiny-random", vocoder="hift", cache_gib=0.05)
        dec.full.factors = key_factors(torch.arange(1024), dec.cfg.flow.d_model, dec.flow.dtype)
        dec._attach_graphs(encoder_graphs=True)
        dec.default_voice = Voice.random(seed=3, n_codes=43)
        dec.capture_graphs(2)
        captured = set(dec.full_enc_graphs.graphs)
        voice = Voice.random(seed=4, n_codes=prompt_codes)
        codes = torch.randint(0, 16384, (n_codes,), generator=torch.Generator().manual_seed(6)).numpy()
        got = dec.stream_all(codes, voice=voice, seed=1)
        replays = sum(g.replays for g, _, _ in dec.full_enc_graphs.graphs.values())
        new = len(set(dec.full_enc_graphs.graphs) - captured)
    want = CodecDecoder.load("tiny-random", vocoder="hift", cache_gib=0.05).stream_all(codes, voice=voice, seed=1)
    return {"error": float(abs(got - want).max()), "captured": len(captured), "replays": replays,
            "captured_while_decoding": new}


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
        if case.pop("kind", None) == "graphs":
            print(json.dumps(graphs_case(**case)), flush=True)
            continue
        fc = FullContextFlow(flow, 400)
        fc.factors = key_factors(torch.arange(1024), flow.cfg.d_model, flow.dtype)  # the CUDA path's table
        calls = []
        fc._encode_rows = _counted(fc._encode_rows, calls)
        err = answers_case(fc, **case)
        print(json.dumps({"error": err, "in_place": len(calls)}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
