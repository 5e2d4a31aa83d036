"""The codec worker's threads and rounds: one chunk per answer per batch, results per chunk, finals, cancels, decoder
failures, first-chunk lanes beside the playing thread (fake decoder; the real one is covered by test_service_batching).
Which answers a round takes and when: test_codec_pacing.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.process.codec_pacing import PLAYING_SOLVE_PARTS
from engines.process.codec_worker import CodecWorker
from engines.speech_out.flow.pages import DecoderCacheFull
from tests.engines.process.codec_fakes import (
    Count,
    FakeDecoder,
    FakeStream,
    collect,
)


def test_chunks_come_out_one_round_at_a_time_and_final_closes():
    dec = FakeDecoder()
    w = CodecWorker(dec, torch.device("cpu"))
    a = FakeStream("a")
    w.push("A", a, list(range(23)))  # 3 chunks ready (5+3, 10+3, 15+3)
    w.push("A", a, [], final=True)
    res = collect(w, lambda o: any(f for _, _, f in o))
    pcm = np.concatenate([p for _, p, _ in res])
    assert pcm.tolist() == list(range(23))  # every code once, in order
    assert len(res) == 5 and [f for _, _, f in res] == [False] * 4 + [True]  # one result per chunk
    assert all(b == ["a"] for b in dec.batches) and a.closed
    assert not w.busy()
    w.close()


def test_cancel_decodes_nothing_more_and_final_still_ends_it():
    dec = FakeDecoder()
    w = CodecWorker(dec, torch.device("cpu"))
    dec.gate.clear()
    a = FakeStream("a")
    w.push("A", a, list(range(43)))
    dec.entered.wait(1)  # its first chunk is being decoded ...
    w.cancel("A")  # ... when it is cancelled
    w.push("A", a, [], final=True)
    dec.gate.set()
    res = collect(w, lambda o: any(f for _, _, f in o))
    assert dec.batches == [["a"]] and a.closed  # only the round already running
    assert res[-1][2] and len(res[-1][1]) == 0
    assert not w.busy()
    w.close()


def test_decoder_failure_ends_the_answers_of_that_batch():
    dec = FakeDecoder()
    dec.fail = True
    w = CodecWorker(dec, torch.device("cpu"))
    w.push("A", FakeStream("a"), list(range(8)))
    res = collect(w, lambda o: len(o) == 1)
    key, err, final = res[0]
    assert key == "A" and isinstance(err, RuntimeError) and final
    assert not w.busy()
    w.close()


def test_a_chunk_that_finds_no_cache_page_ends_its_answer_only_and_is_not_counted_as_decoded():
    dec = FakeDecoder()
    dec.full = {"b"}
    w = CodecWorker(dec, torch.device("cpu"))
    dec.gate.clear()  # both answers' first chunks in one round
    w.push("A", FakeStream("a"), list(range(8)))
    w.push("B", FakeStream("b"), list(range(8)))
    dec.gate.set()
    res = collect(w, lambda o: len(o) == 2)
    by_key = {k: (r, f) for k, r, f in res}
    assert isinstance(by_key["B"][0], DecoderCacheFull) and by_key["B"][1]  # B's final result is its error
    assert by_key["A"][0].tolist() == list(range(5)) and not by_key["A"][1]  # A plays on
    assert sorted(dec.batches[0]) == ["a", "b"] and (w.batches, w.items) == (1, 1)  # the load log's counts
    w.close()


def test_an_error_outside_the_decoder_ends_that_rounds_answers_and_the_thread_goes_on():
    """A fault in the worker's own code (here its check for a first-chunk round to wait for) ends the answers of
    that round with the error, their streams closed; the thread lives on and decodes the next answer."""
    dec = FakeDecoder()
    w = CodecWorker(dec, torch.device("cpu"))
    real_coalesce = w._coalesce
    broken = [True]

    def coalesce(first, now):
        if broken[0]:
            broken[0] = False
            raise KeyError("bookkeeping bug")
        return real_coalesce(first, now)

    w._coalesce = coalesce
    a = FakeStream("a")
    w.push("A", a, list(range(8)), final=True)
    res = collect(w, lambda o: len(o) == 1)
    key, err, final = res[0]
    assert key == "A" and isinstance(err, KeyError) and final and a.closed
    w.push("B", FakeStream("b"), list(range(8)), final=True)
    res = collect(w, lambda o: any(k == "B" and f for k, _, f in o))
    assert [k for k, _, _ in res] == ["B", "B"] and not any(isinstance(p, Exception) for _, p, _ in res)
    assert not w.busy()
    w.close()


def test_a_first_lane_decodes_first_chunks_while_a_playing_round_is_in_flight():
    """With a first-chunk lane, a new answer's first chunk does not wait for the playing round in flight: it is
    decoded on the lane's own thread and decoder, and every later chunk on the other."""
    dec, lane = FakeDecoder(), FakeDecoder()
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[lane])
    a, b = FakeStream("a"), FakeStream("b")
    dec.gate.clear()  # playing rounds hang until released
    w.push("A", a, list(range(13)))  # A's first chunk (on the lane), then its second (held on the other thread)
    collect(w, lambda o: sum(1 for k, _, _ in o if k == "A") == 1)
    dec.entered.wait(1)  # A's second chunk is in its (held) round
    w.push("B", b, list(range(8)))
    got = collect(w, lambda o: any(k == "B" for k, _, _ in o))  # while A's second chunk is still held
    assert [k for k, _, _ in got] == ["B"]
    dec.gate.set()
    rest = collect(w, lambda o: any(k == "A" for k, _, _ in o))
    assert [k for k, _, _ in rest] == ["A"]
    assert lane.batches == [["a"], ["b"]] and dec.batches == [["a"]]
    w.push("A", a, [], final=True)
    w.push("B", b, [], final=True)
    out = collect(w, lambda o: sum(1 for _, _, f in o if f) == 2)
    assert all(bt in (["a"], ["b"], ["a", "b"], ["b", "a"]) for bt in dec.batches) and len(lane.batches) == 2
    assert {k for k, _, f in out if f} == {"A", "B"} and a.closed and b.closed
    assert not w.busy()
    w.close()


def test_a_second_first_lane_decodes_a_new_answer_while_the_first_lane_is_busy(monkeypatch):
    """With two first lanes, a new answer whose first chunk is ready while another's first-chunk round is on the GPU
    is decoded at once on the free lane; a round does not wait (coalesce) for an answer a code short while a lane is
    free for it; the engine loop sees a first-chunk round in flight until both have posted."""
    monkeypatch.setattr("engines.process.codec_pacing.COALESCE_S", 60.0)  # a coalesced round would hang the test
    lanes = Count()
    dec, one, two = FakeDecoder(), FakeDecoder(lanes), FakeDecoder(lanes)
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[one, two])
    assert [t.name for t in w._threads] == ["codec-worker-first", "codec-worker-first-2", "codec-worker-playing"]
    one.gate.clear()
    two.gate.clear()  # first-chunk rounds hang until released
    a, b = FakeStream("a"), FakeStream("b")
    w.push("B", b, list(range(7)))  # a code short of its first chunk: A's round does not wait for it
    w.push("A", a, list(range(8)))
    lanes.wait(1, "first-chunk rounds")  # A's round is on a lane
    w.push("B", b, [7])  # ready while A's round hangs: the other lane takes it
    lanes.wait(2, "first-chunk rounds")
    assert len(w._first_flying) == 2 and w.first_in_flight
    for lane in (one, two):
        lane.gate.set()
    out = collect(w, lambda o: len(o) == 2)
    assert {k for k, _, _ in out} == {"A", "B"}
    assert sorted(one.batches + two.batches) == [["a"], ["b"]] and len(one.batches) == len(two.batches) == 1
    assert not w.first_in_flight and dec.batches == []
    w.push("A", a, [], final=True)
    w.push("B", b, [], final=True)
    collect(w, lambda o: sum(1 for _, _, f in o if f) == 2)
    assert not w.busy()
    w.close()


def test_an_unexpected_error_in_a_round_ends_only_the_answers_it_still_holds():
    """A round that fails outside the decoder ends its batch's answers, not an answer it only fed codes to and let
    go of before decoding (another lane may hold that one by then): it goes on."""
    class BadForA(FakeDecoder):
        def run_jobs(self, jobs, between=None):
            out = super().run_jobs(jobs, between)
            if any(j.stream.name == "a" for j in jobs):
                return [object() for _ in out]  # PCM the worker cannot measure: an error outside the decoder
            return out

    dec = BadForA()
    w = CodecWorker(dec, torch.device("cpu"))
    dec.gate.clear()
    w.push("C", FakeStream("c"), list(range(8)))  # C's round holds the worker ...
    dec.entered.wait(1)
    w.push("A", FakeStream("a"), list(range(8)))  # ... while A (a first chunk) and B (3 codes: too far off for a
    b = FakeStream("b")  # coalesced round) arrive
    w.push("B", b, list(range(3)))  # the next round takes both, feeds B, decodes A and fails
    dec.gate.set()
    out = collect(w, lambda o: any(k == "A" for k, _, _ in o))
    assert [(k, isinstance(p, Exception), f) for k, p, f in out if k != "C"] == [("A", True, True)]
    w.push("B", b, list(range(3, 8)))
    got = collect(w, lambda o: any(k == "B" for k, _, _ in o))
    assert [(k, isinstance(p, np.ndarray)) for k, p, _ in got] == [("B", True)]
    w.close()


@pytest.mark.parametrize("lanes,period_s", [(1, 0.0), (2, 0.0), (1, 0.2)])
def test_first_lanes_give_the_same_pcm_as_one_thread(lanes, period_s, one_torch_thread):
    """The real tiny decoder: answers decoded with first-chunk lanes (first chunks on CodecDecoder.lane), and with
    rounds of playing answers once a period, give the PCM of the offline decode of the same codes (within float32
    rounding: the batches differ)."""
    from engines.speech_out import CodecDecoder

    dec = CodecDecoder.load("tiny-random")
    rng = np.random.default_rng(3)
    codes = {f"s{i}": rng.integers(0, 16384, n).tolist() for i, n in enumerate((23, 9, 31))}
    first = [dec.lane() for _ in range(lanes)]
    dec.flow.solve_parts = PLAYING_SOLVE_PARTS  # as the engine process sets them: playing rounds may pause
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=first, period_s=period_s)
    want = {sid: dec.stream_all(c, seed=i) for i, (sid, c) in enumerate(codes.items())}  # (the lane changed nothing)
    streams = {sid: dec.open_stream(sid, seed=i) for i, sid in enumerate(codes)}
    for sid, c in codes.items():
        w.push(sid, streams[sid], c[:8])
    for sid, c in codes.items():
        w.push(sid, streams[sid], c[8:], final=True)
    out = collect(w, lambda o: sum(1 for _, _, f in o if f) == len(codes))
    for sid in codes:
        got = np.concatenate([p for k, p, _ in out if k == sid])
        np.testing.assert_allclose(got, want[sid], atol=1e-5, rtol=0)
    w.close()


def test_audio_only_takes_the_leading_plain_chunks_and_leaves_the_rest_in_order():
    """What the engine loop may send in the middle of a step (Service.while_stepping): PCM that is not an
    answer's last; from the first last result or failure on, everything waits for the step's end, in order."""
    dec = FakeDecoder()
    dec.gate.clear()
    w = CodecWorker(dec, torch.device("cpu"))
    w.push("A", FakeStream("a"), list(range(8)))  # its first chunk: the round waits on the gate
    dec.entered.wait(1)
    assert w.first_in_flight  # (marked before the decoder is called)
    assert w.take_results(audio_only=True) == []  # a first chunk is on its way
    dec.gate.set()
    res = collect(w, lambda o: len(o) == 1)
    assert not w.first_in_flight  # (cleared once its PCM was posted)
    pcm = np.zeros(3, np.float32)
    items = [("A", pcm, False), ("B", pcm, False), ("A", pcm, True), ("B", pcm, False), ("C", RuntimeError(), True)]
    with w._cv:
        w._results.extend(items)
    assert [k for k, _, _ in w.take_results(audio_only=True)] == ["A", "B"]
    assert w.take_results(audio_only=True) == []  # A's last result is next
    assert [(k, f) for k, _, f in w.take_results()] == [("A", True), ("B", False), ("C", True)]
    assert res[0][0] == "A"
    w.close()
