"""The full-context streaming flow: chunk by chunk, with every earlier chunk's keys and values kept, it equals the
chunk model run over the whole sequence under its chunk-causal mask (`reference.py`), for short and long answers, with
and without a voice prompt, alone or batched with answers at other points; its pages go back to the pool."""

from __future__ import annotations

import pytest
import torch

from engines.speech_out import CodecDecoder
from engines.speech_out.flow.full_context import FullContextFlow
from engines.speech_out.flow.pages import DecoderCacheFull
from tests.engines.speech_out.decoder_rounds import random_position_biases
from tests.engines.speech_out.flow.full_answers import Answer, alone, decode_in_rounds, voice_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Cached and whole-sequence decodes add the same terms in other orders: float32 rounding only.
TOL = 1e-5


@pytest.fixture(scope="module")
def flow():
    dec = CodecDecoder.load("tiny-random", vocoder="hift", context="window")
    random_position_biases(dec.flow)
    return dec.flow


@pytest.mark.parametrize("chunks", [1, 7, 60])
@pytest.mark.parametrize("P", [0, 23, 20])  # none; a tail of 3 codes; a tail of 5 (a chunk of prompt codes alone)
def test_streamed_equals_the_chunk_masked_whole_sequence(flow, chunks, P):
    fc = FullContextFlow(flow, 200)
    N = 5 * chunks - (2 if chunks > 1 else 0)  # a last partial chunk
    a, voice, pcodes, pmel, codes = alone(fc, flow, P, N, seed=P + chunks)
    got = torch.cat(a.mel, 1)
    want = a.reference(flow, pcodes, pmel, codes)
    assert got.shape == want.shape == (80, 4 * N)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    fc.close(a.state)
    fc.forget_voice(voice)
    fc.pages.check()
    assert fc.pages.n_free == fc.pages.n_pages


def test_every_earlier_chunk_matters_and_no_later_one_does(flow):
    """What the windowed decoder drops: a change in the first chunk's codes changes the mel of a chunk far past any
    window; a change after a chunk (beyond its lookahead) leaves it as it was."""
    fc = FullContextFlow(flow, 200)
    pcodes, pmel, xv = voice_inputs(0, 1)
    voice = fc.prepare_voice(pcodes, pmel, xv)
    base = torch.randint(0, 16384, (60,), generator=torch.Generator().manual_seed(3))

    def mel_of(codes):
        a = Answer(fc, voice, codes.tolist(), 5)
        while not a.done:
            row, n, nl = a.job()
            a.took(fc.decode_chunk([a.state], torch.tensor([row]), n, [nl], [a.gen])[0], n)
        fc.close(a.state)
        return torch.cat(a.mel, 1)

    first = base.clone()
    first[0] = (first[0] + 1) % 16384
    last = base.clone()
    last[-1] = (last[-1] + 1) % 16384
    m, m_first, m_last = mel_of(base), mel_of(first), mel_of(last)
    assert (m_first[:, -20:] - m[:, -20:]).abs().max() > 1e-4  # the 12th chunk still hears the first code
    torch.testing.assert_close(m_last[:, :4 * 50], m[:, :4 * 50], atol=0, rtol=0)  # chunks before the 11th: unchanged


@pytest.mark.parametrize("grouped", [False, True])
def test_a_batch_of_answers_at_other_points_and_voices_equals_each_alone(flow, grouped, monkeypatch):
    """grouped: the encoder's keys budgeted to two rows of 40 codes, so that longer rows go through it in groups of
    their own (as one long answer among many does with the served budget)."""
    fc = FullContextFlow(flow, 400)
    if grouped:
        fc.encoder_batch_bytes = 2 * 40 * fc.code_key_bytes
        calls, rounds = [], []
        encode, decode = fc._encode, fc.decode_chunk
        monkeypatch.setattr(fc, "_encode", lambda states, *a: calls.append(len(states)) or encode(states, *a))
        monkeypatch.setattr(fc, "decode_chunk", lambda states, *a: rounds.append(len(states)) or decode(states, *a))
    specs = [(0, 23, 1), (23, 31, 2), (17, 9, 3), (23, 40, 4)]  # (prompt codes, answer codes, seed)
    each = []
    for P, N, seed in specs:
        a, voice, *_ = alone(fc, flow, P, N, seed)
        each.append(torch.cat(a.mel, 1))
        fc.close(a.state)
        fc.forget_voice(voice)
    answers = []
    for P, N, seed in specs:
        pcodes, pmel, xv = voice_inputs(P, seed)
        codes = torch.randint(0, 16384, (N,), generator=torch.Generator().manual_seed(seed + 1))
        answers.append(Answer(fc, fc.prepare_voice(pcodes, pmel, xv), codes.tolist(), seed))
    decode_in_rounds(fc, answers)
    for a, want in zip(answers, each, strict=True):
        torch.testing.assert_close(torch.cat(a.mel, 1), want, atol=TOL, rtol=0)
        fc.close(a.state)
        fc.forget_voice(a.voice)
    assert fc.pages.n_free == fc.pages.n_pages
    if grouped:  # some rounds went through the encoder in several calls, some of them of several answers
        assert len(calls) > len(rounds) and sum(calls) == sum(rounds) and max(calls) > 1


def test_a_voice_pages_are_shared_and_held_until_its_last_answer_ends(flow):
    fc = FullContextFlow(flow, 50)
    voice = fc.prepare_voice(*voice_inputs(43, 7))  # 8 whole chunks shared, a tail of 3
    assert voice.n_codes == 40 and len(voice.pages) == 8 and len(voice.tail) == 3
    a, b = fc.new_state(voice), fc.new_state(voice)
    fc.reserve(a, 2)
    assert fc.pages.n_free == 50 - 8 - 2
    fc.forget_voice(voice)  # evicted from the decoder's cache while answers still speak in it
    assert fc.pages.n_free == 50 - 8 - 2
    fc.close(a)
    fc.close(b)
    assert fc.pages.n_free == 50
    fc.pages.check()


def test_a_full_cache_refuses_the_answer_that_asks_and_takes_nothing(flow):
    fc = FullContextFlow(flow, 3)
    voice = fc.prepare_voice(*voice_inputs(0, 1))
    s = fc.new_state(voice)
    fc.reserve(s, 2)
    with pytest.raises(DecoderCacheFull, match="cache is full"):
        fc.reserve(s, 2)
    assert fc.pages.n_free == 1
    fc.close(s)
    assert fc.pages.n_free == 3


def test_one_chunk_without_a_prompt_is_the_same_in_the_offline_model(flow):
    """Within one chunk the chunk mask blocks nothing: streaming and the offline model agree; over more chunks they
    differ (the offline model attends ahead)."""
    fc = FullContextFlow(flow, 50)
    a, _, pcodes, pmel, codes = alone(fc, flow, 0, 5, seed=9)
    torch.testing.assert_close(torch.cat(a.mel, 1), a.reference(flow, pcodes, pmel, codes, chunk=False), atol=TOL,
                               rtol=0)
    b, _, pcodes, pmel, codes = alone(fc, flow, 0, 12, seed=9)
    assert (torch.cat(b.mel, 1) - b.reference(flow, pcodes, pmel, codes, chunk=False)).abs().max() > 1e-3


@pytest.mark.parametrize("P", [23, 20, 17])  # tails of 3, 5 and 7 codes
def test_an_answers_first_job_of_several_chunks_equals_the_whole_sequence(flow, P):
    """A stream's first job is the prompt's tail and the answer's first codes up to the chunk boundary that gives a
    chunk of answer (DecodeStream.take_jobs): decoded in one call, chunk after chunk."""
    fc = FullContextFlow(flow, 100)
    pcodes, pmel, xv = voice_inputs(P, 4)
    codes = torch.randint(0, 16384, (17,), generator=torch.Generator().manual_seed(8))
    voice = fc.prepare_voice(pcodes, pmel, xv)
    a = Answer(fc, voice, codes.tolist(), 2)
    first = -(-(len(voice.tail) + 5) // 5) * 5
    while not a.done:
        row, n, nl = a.job(first if a.i == 0 else None)
        a.took(fc.decode_chunk([a.state], torch.tensor([row]), n, [nl], [a.gen])[0], n)
    assert a.mel[0].shape[1] >= 4 * 5  # the first audio is at least a chunk
    torch.testing.assert_close(torch.cat(a.mel, 1), a.reference(flow, pcodes, pmel, codes), atol=TOL, rtol=0)
    fc.close(a.state)
    fc.forget_voice(voice)
    assert fc.pages.n_free == fc.pages.n_pages


class _EagerGraphs:
    """Stands in for FullSolveGraphs on a CPU: the same inputs (pages padded to a bucket, a last chunk padded to a
    whole one), run eagerly."""

    def __init__(self, fc: FullContextFlow) -> None:
        self.fc, self.shapes = fc, []

    def run(self, args):
        self.shapes.append((tuple(args[0].shape), tuple(args[5].shape)))
        return self.fc.euler(*args)


def test_the_graphs_inputs_pages_bucket_and_a_padded_last_chunk_give_the_whole_sequence(flow):
    fc = FullContextFlow(flow, 100)
    graphs = _EagerGraphs(fc)
    pcodes, pmel, xv = voice_inputs(23, 6)
    codes = torch.randint(0, 16384, (97,), generator=torch.Generator().manual_seed(6))  # ends with a 2-code chunk
    voice = fc.prepare_voice(pcodes, pmel, xv)
    a = Answer(fc, voice, codes.tolist(), 3)
    while not a.done:
        row, n, nl = a.job()
        a.took(fc.decode_chunk([a.state], torch.tensor([row]), n, [nl], [a.gen], graphs)[0], n)
    assert {s for s, _ in graphs.shapes} == {(1, 80, 20)}  # every chunk as a whole one, the last one too
    assert {p for _, p in graphs.shapes} == {(1, 16), (1, 32)}  # pages read in buckets of 16
    torch.testing.assert_close(torch.cat(a.mel, 1), a.reference(flow, pcodes, pmel, codes), atol=TOL, rtol=0)


def test_first_jobs_of_a_batch_through_the_graphs_inputs_give_the_whole_sequence(flow):
    """Answers' first jobs (the prompt's tail and their first codes, several chunks) in one batch and one pass, one
    answer ending inside its first job (its last chunk padded to a whole one): each equals its whole sequence."""
    fc = FullContextFlow(flow, 200)
    graphs = _EagerGraphs(fc)
    specs = [(23, 12, 1), (33, 30, 2), (28, 4, 3)]  # (prompt codes, answer codes, seed): tails of 3 codes
    answers, prompts = [], []
    for P, N, seed in specs:
        pcodes, pmel, xv = voice_inputs(P, seed)
        codes = torch.randint(0, 16384, (N,), generator=torch.Generator().manual_seed(seed + 1))
        answers.append(Answer(fc, fc.prepare_voice(pcodes, pmel, xv), codes.tolist(), seed))
        prompts.append((pcodes, pmel, codes))
    # First jobs of 10 codes (2 chunks); the short answer's is all its 7, grouped apart as run_jobs groups by length.
    jobs = [(a, *a.job(min(10, len(a.seq)))) for a in answers]
    assert sorted(j[2] for j in jobs) == [7, 10, 10]
    for n in (7, 10):
        group = [j for j in jobs if j[2] == n]
        out = fc.decode_chunk([j[0].state for j in group], torch.tensor([j[1] for j in group]), n,
                              [j[3] for j in group], [j[0].gen for j in group], graphs)
        for b, j in enumerate(group):
            j[0].took(out[b], n)
    assert {s for s, _ in graphs.shapes} == {(1, 80, 40), (2, 80, 40)}  # two chunks each, in one pass
    while not all(a.done for a in answers):
        for a in answers:
            if not a.done:
                row, n, nl = a.job()
                a.took(fc.decode_chunk([a.state], torch.tensor([row]), n, [nl], [a.gen], graphs)[0], n)
    for a, (pcodes, pmel, codes) in zip(answers, prompts, strict=True):
        torch.testing.assert_close(torch.cat(a.mel, 1), a.reference(flow, pcodes, pmel, codes), atol=TOL, rtol=0)
        fc.close(a.state)
        fc.forget_voice(a.voice)
    assert fc.pages.n_free == fc.pages.n_pages


def test_a_job_whose_solve_fails_leaves_its_pages_for_close(flow, monkeypatch):
    """A solve that raises (a CUDA error, a graph that cannot be captured) must not lose the pages its job took."""
    fc = FullContextFlow(flow, 50)
    pcodes, pmel, xv = voice_inputs(23, 5)
    voice = fc.prepare_voice(pcodes, pmel, xv)
    a = Answer(fc, voice, list(range(1, 20)), 1)
    row, n, nl = a.job(10)

    def broken(*args):
        raise RuntimeError("solve failed")
    monkeypatch.setattr(fc, "euler", broken)
    with pytest.raises(RuntimeError, match="solve failed"):
        fc.decode_chunk([a.state], torch.tensor([row]), n, [nl], [a.gen])
    fc.close(a.state)
    fc.forget_voice(voice)
    fc.pages.check()
    assert fc.pages.n_free == fc.pages.n_pages


def test_a_long_answer_in_a_short_cache_forgets_its_oldest_chunks_and_goes_on(flow):
    """With fewer than `low_water` pages free, an answer holding more than `kept_pages` (decoded and reserved)
    drops its oldest chunks as its next one's page is taken, where it would otherwise stop for want of a page: until
    then it is the full-context decode exactly; after, the estimator no longer hears the forgotten chunks; every page
    comes back."""
    pcodes, pmel, xv = voice_inputs(23, 11)  # 4 shared pages, a tail of 3
    codes = torch.randint(0, 16384, (60,), generator=torch.Generator().manual_seed(12)).tolist()
    roomy = FullContextFlow(flow, 100)
    want = Answer(roomy, roomy.prepare_voice(pcodes, pmel, xv), codes, 13)
    short = FullContextFlow(flow, 4 + 8, kept_pages=3, low_water=2)  # the answer's 13 pages never fit at once
    a = Answer(short, short.prepare_voice(pcodes, pmel, xv), codes, 13)
    first_forget, forgotten = None, 0
    for x in (want, a):
        while not x.done:
            row, n, nl = x.job()
            x.took(x.fc.decode_chunk([x.state], torch.tensor([row]), n, [nl], [x.gen])[0], n)
            if x is a and short.forgotten > forgotten:
                forgotten = short.forgotten
                assert len(a.state.pages) == 3 and not a.state.reserved  # what it keeps, the chunk just decoded in
                if first_forget is None:
                    first_forget = len(a.mel) - 1  # the first chunk decoded without its oldest ones
    assert first_forget is not None and short.forgotten == 13 - len(a.state.pages)
    for k, (got, ref) in enumerate(zip(a.mel, want.mel, strict=True)):
        if k < first_forget:
            torch.testing.assert_close(got, ref, atol=0, rtol=0)
    assert (torch.cat(a.mel[first_forget:], 1) - torch.cat(want.mel[first_forget:], 1)).abs().max() > 1e-4
    for fc, x in ((short, a), (roomy, want)):
        fc.close(x.state)
        fc.forget_voice(x.voice)
        fc.pages.check()
        assert fc.pages.n_free == fc.pages.n_pages


def test_answers_within_their_kept_chunks_never_forget(flow):
    """Forgetting takes only what an answer holds past `kept_pages`: a short answer in a short cache keeps all."""
    fc = FullContextFlow(flow, 4 + 6, kept_pages=6, low_water=10)  # always short, but the answer keeps 6
    a, voice, pcodes, pmel, codes = alone(fc, flow, 23, 25, seed=14)  # 28 codes with the tail: 6 pages
    assert fc.forgotten == 0 and len(a.state.pages) == 6
    torch.testing.assert_close(torch.cat(a.mel, 1), a.reference(flow, pcodes, pmel, codes), atol=TOL, rtol=0)
    fc.close(a.state)
    fc.forget_voice(voice)
    assert fc.pages.n_free == fc.pages.n_pages
