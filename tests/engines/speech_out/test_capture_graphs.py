"""What `CodecDecoder.capture_graphs` captures at load for the full-context decoder, on a CPU with the graph stand-in
(graph_stand_in.py): every graph an answer in the default voice or any other replays, so none is captured while
serving (a capture stalls the codec for 0.8-1.6 s on an H200), and no first job's graph for a decoder whose first
jobs run on lanes of their own. The GPU twin: tests/gpu/test_full_context_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from engines.speech_out import CodecDecoder, Voice
from engines.speech_out.chunk_graphs import FINE_BUCKETS
from tests.engines.speech_out.decoder_rounds import in_rounds
from tests.engines.speech_out.graph_stand_in import replay_stand_in

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A prompt of 43 codes leaves a tail of 3 past its whole chunks: the first job is 2 chunks (the tail and 7 answer
# codes), and the vocoder renders its 7 answer codes, a window no chunk has.
PROMPT_CODES = 43


def _graphed(monkeypatch, max_batch: int = 2, **capture) -> tuple[CodecDecoder, dict[str, set]]:
    """A CPU decoder with graph stand-ins, the default voice's prompt PROMPT_CODES, after capture_graphs(max_batch): it
    and the keys captured, by graph set ("solve", "vocoder"). (The encoder's graphs run its CUDA launch: they are
    tested in the Triton interpreter, tests/engines/kernels/test_encoder_attention_interpreted.py, and on a GPU.)"""
    replay_stand_in(monkeypatch)
    dec = CodecDecoder.load("tiny-random", vocoder="hift", cache_gib=0.05)
    dec._attach_graphs(encoder_graphs=False)
    dec.default_voice = Voice.random(seed=3, n_codes=PROMPT_CODES)
    dec.capture_graphs(max_batch, **capture)
    return dec, {"solve": set(dec.full_graphs.graphs), "vocoder": set(dec.vocoder.graphs.graphs)}


def _first_jobs(dec: CodecDecoder, keys: dict[str, set]) -> dict[str, set]:
    """Of `keys`, those of a first job: the solve's of several chunks at once, the vocoder's windows over more than a
    chunk of answer codes (keys' second item: the first input's shape, [80, frames])."""
    chunk, ctx = dec.full.page_frames, dec.cfg.stream.voc_ctx_frames
    return {"solve": {k for k in keys["solve"] if k[1][1] > chunk},
            "vocoder": {k for k in keys["vocoder"] if k[1][1] > ctx + chunk}}


@pytest.mark.parametrize("prompt_codes", [PROMPT_CODES, 46, 2])  # tails of 3 (the default voice's), 6 and 2 codes
def test_an_answer_in_any_voice_replays_only_graphs_captured_at_load(monkeypatch, prompt_codes):
    dec, keys = _graphed(monkeypatch)
    # First jobs of 2 and 3 chunks, the vocoder over 6..9 answer codes, each at batches 1 and 2.
    assert {n: len(k) for n, k in _first_jobs(dec, keys).items()} == {"solve": 4, "vocoder": 8}
    voice = Voice.random(seed=4, n_codes=prompt_codes)
    codes = np.random.default_rng(6).integers(0, 16384, 24)  # the first job, then chunks and a last partial one
    got = dec.stream_all(codes, voice=voice, seed=1)
    assert {"solve": set(dec.full_graphs.graphs), "vocoder": set(dec.vocoder.graphs.graphs)} == keys
    eager = CodecDecoder.load("tiny-random", vocoder="hift", cache_gib=0.05)
    np.testing.assert_allclose(got, eager.stream_all(codes, voice=voice, seed=1), atol=1e-4, rtol=0)


def test_a_decoder_whose_first_jobs_run_on_lanes_captures_the_same_less_theirs(monkeypatch):
    dec, served = _graphed(monkeypatch)
    first = _first_jobs(dec, served)
    _, elsewhere = _graphed(monkeypatch, first_jobs=False)
    assert elsewhere == {n: served[n] - first[n] for n in served}
    assert all(first.values())


def test_each_graph_set_captures_its_batches_largest_first(monkeypatch):
    """A set's captures share one memory pool: a smaller capture reuses what a larger one freed, not the reverse."""
    dec, _ = _graphed(monkeypatch, max_batch=40)
    for graphs in (dec.full_graphs.graphs, dec.vocoder.graphs.graphs):
        by_shape: dict[tuple, list[int]] = {}
        for key in graphs:  # in capture order
            by_shape.setdefault(key[1:], []).append(key[0])
        assert len(by_shape) > 1 and all(b == sorted(b, reverse=True) and len(b) > 1 for b in by_shape.values())
        firsts = [b[0] for b in by_shape.values()]
        assert next(iter(graphs))[0] == max(firsts)


def test_a_round_of_playing_answers_replays_a_solve_at_most_a_quarter_larger(monkeypatch):
    """Padded rows of a graphed solve do a real row's work: a round of 20 answers replays the graph of 20 (captured at
    load in quarter steps from 16), not of 32."""
    dec, keys = _graphed(monkeypatch, max_batch=40, first_jobs=False)
    one_chunk = {k[0] for k in keys["solve"] if k[1][1] == dec.full.page_frames}
    assert sorted(one_chunk) == [b for b in FINE_BUCKETS if b <= 40]
    streams = [dec.open_stream(f"s{i}", seed=i) for i in range(20)]
    for i, s in enumerate(streams):
        s.add(np.random.default_rng(i).integers(0, 16384, 18))  # a first job, then a chunk each
    replayed = []  # a round of one chunk each: (rows, the batch of the graph it replayed)
    g = dec.full_graphs
    run = g.run

    def counted(args):
        out = run(args)
        if args[0].shape[2] == dec.full.page_frames:
            replayed.append((args[0].shape[0], g.last_batch))
        return out
    monkeypatch.setattr(g, "run", counted)
    in_rounds(dec, streams)
    assert replayed and set(replayed) == {(20, 20)}, replayed
