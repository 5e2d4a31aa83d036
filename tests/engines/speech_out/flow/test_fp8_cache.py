"""The full-context flow's cache in fp8 (`--decoder-cache-dtype fp8`): its pages hold each key and value as
`to_cache` rounds it (e4m3, saturated), half the bytes, so a cache of the same size holds twice the chunks; an answer
streamed through it stays within fp8 rounding of the chunk model's whole-sequence decode, and its pages come back."""

from __future__ import annotations

import pytest
import torch

from engines.config import ConfigError, to_cache
from engines.speech_out import CodecDecoder
from engines.speech_out.flow.full_context import FullContextFlow
from tests.engines.speech_out.decoder_rounds import random_position_biases
from tests.engines.speech_out.flow.full_answers import alone, voice_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def flow():
    dec = CodecDecoder.load("tiny-random", vocoder="hift", context="window")
    random_position_biases(dec.flow)
    return dec.flow


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def test_the_first_block_pages_hold_the_keys_and_values_rounded_to_fp8(flow):
    """A voice's prompt in one pass: the first transformer block of the first Euler step reads nothing a page rounded
    before it, so its pages are exactly the float32 cache's, rounded."""
    pcodes, pmel, xv = voice_inputs(43, 7)
    exact, fp8 = FullContextFlow(flow, 20), FullContextFlow(flow, 20, cache_dtype=FP8)
    v32, v8 = exact.prepare_voice(pcodes, pmel, xv), fp8.prepare_voice(pcodes, pmel, xv)
    assert fp8.pages.pool.dtype == FP8 and v8.left.dtype == v32.left.dtype == torch.float32
    want = exact.pages.pool[0, 0][:, :, v32.pages]  # [2 kv, 2 branch, pages, frames, width]
    got = fp8.pages.pool[0, 0][:, :, v8.pages]
    assert torch.equal(got.view(torch.uint8), to_cache(want, FP8).view(torch.uint8))
    # later blocks read rounded keys: close to the float32 cache's, not equal
    later = (fp8.pages.pool[-1, -1][:, :, v8.pages].float() - exact.pages.pool[-1, -1][:, :, v32.pages]).abs()
    assert 0 < later.max() < 0.25 * exact.pages.pool[-1, -1].abs().max()


@pytest.mark.parametrize(("P", "chunks"), [(0, 7), (23, 60)])
def test_an_answer_through_an_fp8_cache_stays_within_its_rounding_of_the_whole_sequence(flow, P, chunks):
    N = 5 * chunks - 2
    fc32, fc8 = FullContextFlow(flow, 200), FullContextFlow(flow, 200, cache_dtype=FP8)
    a32, *_ = alone(fc32, flow, P, N, seed=P + chunks)
    a8, voice, pcodes, pmel, codes = alone(fc8, flow, P, N, seed=P + chunks)
    want = a8.reference(flow, pcodes, pmel, codes)
    exact, got = torch.cat(a32.mel, 1), torch.cat(a8.mel, 1)
    torch.testing.assert_close(exact, want, atol=1e-5, rtol=0)  # the same answer and noise
    # e4m3 keeps 3 mantissa bits (relative steps of 1/16): attention averages the rounding out
    assert 0 < _rel_rms(got, want) < 1e-2
    fc8.close(a8.state)
    fc8.forget_voice(voice)
    fc8.pages.check()
    assert fc8.pages.n_free == fc8.pages.n_pages


def test_an_fp8_cache_holds_twice_the_chunks_in_the_same_memory():
    load = {"vocoder": "hift", "context": "full", "cache_gib": 0.25, "estimator_dtype": "bfloat16"}  # as served
    auto = CodecDecoder.load("tiny-random", **load)
    fp8 = CodecDecoder.load("tiny-random", **load, cache_dtype="fp8")
    assert fp8.full.pages.pool.dtype == FP8 and auto.full.pages.pool.dtype == torch.bfloat16
    assert fp8.full.pages.n_pages // 2 == auto.full.pages.n_pages  # (the same bytes, rounded down to whole pages)
    with pytest.raises(ConfigError, match="decoder cache dtype 'int8' not one of"):
        CodecDecoder.load("tiny-random", **load, cache_dtype="int8")
