"""Which answers a round of the codec worker takes, and when (codec_pacing.py): new answers' first chunks first,
playing answers only as far ahead as needed, short rounds unless answers are about to run dry, rounds held or paused
while a new answer waits, rounds once a period (fakes in codec_fakes.py)."""

from __future__ import annotations

import torch

from engines.process.codec_worker import CodecWorker
from tests.engines.process.codec_fakes import (
    FakeDecoder,
    FakeStream,
    Idle,
    collect,
    held_rounds,
    pauses,
)


def test_answers_without_audio_go_first_and_share_rounds():
    dec = FakeDecoder()
    dec.sample_rate = 1  # 5 s of audio per chunk: A is far ahead of real time once it plays (the clock stands still)
    w = CodecWorker(dec, torch.device("cpu"), max_batch=1, clock=lambda: 100.0)
    dec.gate.clear()  # hold the first round while both answers queue up
    a, b = FakeStream("a"), FakeStream("b")
    w.push("A", a, list(range(43)))  # 7 chunks ready
    dec.entered.wait(1)  # A's first chunk is in its round
    w.push("B", b, list(range(8)))  # its first chunk
    dec.gate.set()
    collect(w, lambda o: sum(1 for k, _, _ in o if k == "B") == 1)
    first_b = next(i for i, bt in enumerate(dec.batches) if bt == ["b"])
    assert first_b == 1  # right after the round that was running when it arrived (A's first chunk)
    w.close()

    dec = FakeDecoder()
    w = CodecWorker(dec, torch.device("cpu"))
    w.push("A", FakeStream("a"), list(range(13)))  # 2 chunks ready each
    w.push("B", FakeStream("b"), list(range(13)))
    collect(w, lambda o: len(o) == 4)
    assert sorted(sorted(b) for b in dec.batches) in ([["a", "b"], ["a", "b"]], [["a"], ["a", "b"], ["b"]])
    w.close()


def test_playing_answers_are_decoded_only_as_far_ahead_as_needed():
    dec = FakeDecoder()
    dec.sample_rate = 5  # one chunk = 1 s of audio
    now = [100.0]
    w = CodecWorker(dec, torch.device("cpu"), ahead_s=2.5, clock=lambda: now[0])
    idle = Idle(w)
    a = FakeStream("a")
    idle.push("A", a, list(range(43)))  # 7 chunks ready
    res = collect(w, lambda o: len(o) == 3)
    idle.wait()
    assert len(res + w.take_results()) == 3  # 3 s posted at t=100: 3 - 0 >= 2.5 ahead, the 4th waits
    now[0] += 0.6  # 2.4 s ahead now: due
    idle.push("A", a, [])  # (any event wakes the worker; its timed wait uses the real clock)
    assert len(collect(w, lambda o: len(o) == 1)) == 1
    idle.wait()
    assert w.take_results() == []  # 3.4 s ahead again
    # A new answer's first chunk is not held back by that pacing, and comes before A's next chunk.
    dec.batches.clear()
    now[0] += 5.0  # A is due again
    w.push("B", FakeStream("b"), list(range(8)))
    collect(w, lambda o: sum(1 for k, _, _ in o if k == "B") == 1)
    assert dec.batches[0] == ["b"]
    w.close()


def test_first_chunk_rounds_do_not_starve_an_answer_about_to_run_dry():
    dec = FakeDecoder()
    dec.sample_rate = 50  # one chunk = 0.1 s: A is always about to run dry
    dec.gate.clear()
    w = CodecWorker(dec, torch.device("cpu"), max_batch=1)
    w.push("A", FakeStream("a"), list(range(23)))
    dec.entered.wait(1)  # A's first chunk is in its round
    for k in "bcd":  # new answers keep arriving
        w.push(k.upper(), FakeStream(k), list(range(8)))
    dec.gate.set()
    collect(w, lambda o: len(o) == 7)
    # A's first chunk, then (a first-chunk round just ran and A is nearly dry) A, then new and A alternate.
    assert dec.batches[:7] == [["a"], ["a"], ["b"], ["a"], ["c"], ["a"], ["d"]]
    w.close()


def test_rounds_of_playing_answers_are_short_unless_more_are_about_to_run_dry():
    """Playing answers go at most bulk_max per round (a new answer's first chunk then waits less), except that every
    answer about to run dry is taken."""
    for rate, want in ((5, [12, 8, 4]), (50, [12, 12])):  # one chunk = 1 s of audio (not urgent) or 0.1 s (urgent)
        dec = FakeDecoder()
        dec.sample_rate = rate
        w = CodecWorker(dec, torch.device("cpu"), ahead_s=2.5, clock=lambda: 100.0, bulk_max=8)
        with w._cv:  # (re-entrant) every answer at once, so the first round sees them all
            for i in range(12):
                w.push(i, FakeStream(f"s{i}"), list(range(13)))  # two chunks each
        collect(w, lambda o, n=sum(want): len(o) == n)
        assert [len(b) for b in dec.batches] == want
        w.close()


def test_rounds_of_playing_answers_wait_while_the_language_model_ramps_up(monkeypatch):
    monkeypatch.setattr("engines.process.codec_pacing.BULK_HOLD_S", 60.0)  # held as long as the ramp lasts
    seen_in_flight = []

    class Recording(FakeDecoder):
        def run_jobs(self, jobs, between=None):
            seen_in_flight.append(w.first_in_flight)
            return super().run_jobs(jobs, between)

    dec = Recording()
    dec.sample_rate = 5  # 1 s per chunk: A is not about to run dry after its first chunk (the clock stands still)
    w = CodecWorker(dec, torch.device("cpu"), clock=lambda: 100.0)
    held = held_rounds(w)
    w.lm_ramping = True  # another answer waits for its first codes
    w.push("A", FakeStream("a"), list(range(13)))  # 2 chunks ready
    collect(w, lambda o: len(o) == 1)  # a first chunk is never held
    held.wait(1, "rounds held back")
    assert w.take_results() == [] and len(dec.batches) == 1  # A's next chunk waits for the ramp
    w.lm_ramping = False
    w.push("A", FakeStream("a"), [])  # (wakes the worker)
    assert len(collect(w, lambda o: len(o) == 1)) == 1
    assert seen_in_flight == [True, False]  # the engine loop sees the first-chunk round on the GPU
    assert not w.first_in_flight
    w.close()


def test_a_first_chunk_round_waits_briefly_for_another_answer_about_to_have_one(monkeypatch):
    monkeypatch.setattr("engines.process.codec_pacing.COALESCE_S", 60.0)
    dec = FakeDecoder()
    w = CodecWorker(dec, torch.device("cpu"))
    held = held_rounds(w)
    w.push("B", FakeStream("b"), list(range(7)))  # one code short of its first chunk
    w.push("A", FakeStream("a"), list(range(8)))
    held.wait(1, "rounds held back")
    assert dec.batches == []  # A's round waits for B's next code
    w.push("B", FakeStream("b"), [7])
    collect(w, lambda o: len(o) == 2)
    assert sorted(dec.batches[0]) == ["a", "b"]  # one round for both
    w.close()


def test_rounds_of_playing_answers_with_a_period_take_every_answer_due_before_the_next():
    """With `period_s`, a round of playing answers starts at most once a period, sooner only for an answer about to
    run dry, and takes every answer due before the next one could start (not bulk_max of them)."""
    dec, lane = FakeDecoder(), FakeDecoder()
    dec.sample_rate = lane.sample_rate = 5  # one chunk = 1 s of audio
    now = [100.0]
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[lane], ahead_s=2.5, clock=lambda: now[0],
                    bulk_max=2, period_s=10.0)
    idle = Idle(w)
    streams = [FakeStream(n) for n in "abcd"]
    for i, st in enumerate(streams):
        w.push(i, st, list(range(8)))
    collect(w, lambda o: len(o) == 4)  # first chunks, on the lane: 1 s ahead each
    with w._cv:  # (re-entrant) every answer's next codes at once, so the first round sees them all
        for i, st in enumerate(streams):
            w.push(i, st, list(range(15)))  # 3 more chunks each
    collect(w, lambda o: len(o) == 4)
    assert dec.batches == [["a", "b", "c", "d"]]  # all due (1 s < 2.5 s ahead), bulk_max notwithstanding
    now[0] = 101.0  # 1 s ahead each (2 s posted): due, but within the period
    idle.push(0, streams[0], [])  # (wakes the worker)
    idle.wait("playing")
    assert w.take_results() == [] and len(dec.batches) == 1
    now[0] = 101.9  # 0.1 s ahead: about to run dry, so the next round starts before the period ends
    w.push(0, streams[0], [])
    collect(w, lambda o: len(o) == 4)
    assert dec.batches[1] == ["a", "b", "c", "d"]
    now[0] = 102.5  # 0.5 s ahead, not yet dry: held again (the period began at 101.9)
    idle.push(0, streams[0], [])
    idle.wait("playing")
    assert w.take_results() == [] and len(dec.batches) == 2
    now[0] = 111.95  # the period is over: the answers that ran dry meanwhile go together
    w.push(0, streams[0], [])
    collect(w, lambda o: len(o) == 4)
    assert dec.batches[2] == ["a", "b", "c", "d"]
    w.close()


def test_an_answers_last_chunk_about_to_be_needed_does_not_wait_for_the_period():
    """With a period, an answer whose only work left is its last (partial) chunk, pushed as final with no new codes,
    is decoded at once when it is about to run dry, not at the end of the period."""
    dec, lane = FakeDecoder(), FakeDecoder()
    dec.sample_rate = lane.sample_rate = 5  # one chunk = 1 s of audio
    now = [100.0]
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[lane], ahead_s=2.5, clock=lambda: now[0],
                    period_s=10.0)
    idle = Idle(w)
    st = FakeStream("a")
    w.push("A", st, list(range(13)))  # two chunks (the first on the lane), 3 codes left over
    collect(w, lambda o: len(o) == 2)
    now[0] = 101.9  # 0.1 s ahead, within the period that began at 100
    idle.push("A", st, [], final=True)
    idle.wait("playing")  # the playing thread looked at it (at 101.9) and has nothing left to do ...
    out = w.take_results()  # ... because it decoded it then
    assert [f for _, _, f in out] == [True] and len(out[-1][1]) == 3 and st.closed
    w.close()


def test_a_cancelled_answer_ends_at_once_within_a_period():
    """With a period, a playing answer cancelled (its final pushed) between two rounds ends at once: its end is posted
    (the engine's ResponseDone, and the session's next inputs, wait for it) with the clock standing still inside the
    period, not at the next wake-up some other answer happens to cause (with one session: never)."""
    dec, lane = FakeDecoder(), FakeDecoder()
    dec.sample_rate = lane.sample_rate = 5  # one chunk = 1 s of audio
    now = [100.0]
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[lane], ahead_s=2.5, clock=lambda: now[0],
                    period_s=10.0)
    st = FakeStream("a")
    w.push("A", st, list(range(13)))  # two chunks (the first on the lane, the second in a playing round at 100)
    collect(w, lambda o: len(o) == 2)
    assert dec.batches == [["a"]]  # the period began at 100
    now[0] = 100.5
    with w._cv:  # the barge-in: the language model's last codes, then the cancel
        w.push("A", st, list(range(4)), final=True)
        w.cancel("A")
    out = collect(w, lambda o: len(o) == 1)
    assert [(k, len(pcm), final) for k, pcm, final in out] == [("A", 0, True)] and st.closed
    assert dec.batches == [["a"]]  # nothing more decoded
    w.close()


def test_a_playing_round_pauses_between_pieces_while_a_new_answer_waits(monkeypatch):
    """With a first lane, a round of playing answers that has started stops queueing GPU work at its next piece while
    another answer waits for its first codes, and goes on once none does; it is never held past BULK_HOLD_S."""
    monkeypatch.setattr("engines.process.codec_pacing.BULK_HOLD_S", 60.0)
    dec, lane = FakeDecoder(), FakeDecoder()
    dec.sample_rate = 1  # 5 s per chunk: A is far from running dry
    now = [100.0]
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[lane], ahead_s=60.0,  # A's next chunk is due at once
                    clock=lambda: now[0])
    paused, held = pauses(w), held_rounds(w)
    dec.gate.clear()
    w.push("A", FakeStream("a"), list(range(13)))  # first chunk on the lane, the second in a playing round
    collect(w, lambda o: len(o) == 1)
    dec.entered.wait(1)  # the round is in run_jobs, before its first piece
    w.lm_ramping = True  # meanwhile another answer starts
    dec.gate.set()
    paused.wait(2, "looks that pause the round")  # it paused, and paused again after its first wait
    assert w.take_results() == []  # paused between its pieces
    assert dec.betweens == [True]
    w.lm_ramping = False
    got = collect(w, lambda o: len(o) == 1)
    assert [k for k, _, _ in got] == ["A"]
    count, seconds, _ = w.take_spans()["codec round paused"]
    assert count == 1 and seconds > 0  # (count, total seconds, max): the round's pause, recorded once
    monkeypatch.setattr("engines.process.codec_pacing.BULK_HOLD_S", 0.05)
    w.lm_ramping = True  # the ramp never ends: the next round pauses no longer than the hold
    n = held.n
    w.push("A", FakeStream("a"), [], final=True)  # A's last chunk: first held back before its round starts ...
    held.wait(n + 1, "rounds held back")
    now[0] += 0.06  # ... no longer than the hold on the worker's clock (then paused, as long on the real one)
    out = collect(w, lambda o: any(f for _, _, f in o))
    assert [(k, f) for k, _, f in out] == [("A", True)] and dec.betweens == [True, True]
    w.close()


def test_a_playing_round_about_to_run_dry_is_never_paused():
    dec, lane = FakeDecoder(), FakeDecoder()  # sample_rate 24000: a chunk is ~0 s of audio, A runs dry at once
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[lane])
    w.lm_ramping = True  # another answer waits for its first codes throughout
    w.push("A", FakeStream("a"), list(range(13)))
    collect(w, lambda o: len(o) == 2)
    assert dec.betweens == [False] and lane.betweens == [False]  # a first chunk never pauses either
    w.close()


def test_a_paused_round_goes_on_when_another_playing_answer_nears_the_end_of_its_audio(monkeypatch):
    """A paused round holds the playing thread: it stops pausing once an answer outside it has a chunk to decode and
    less than URGENT_S of audio ahead, even while a new answer still waits."""
    monkeypatch.setattr("engines.process.codec_pacing.BULK_HOLD_S", 60.0)
    now = [0.0]
    dec, lane = FakeDecoder(), FakeDecoder()
    dec.sample_rate = lane.sample_rate = 0.5  # 10 s of audio per chunk
    w = CodecWorker(dec, torch.device("cpu"), first_decoders=[lane], ahead_s=60.0, clock=lambda: now[0])
    paused = pauses(w)
    dec.gate.clear()
    w.push("A", FakeStream("a"), list(range(13)))
    collect(w, lambda o: len(o) == 1)
    dec.entered.wait(1)  # A's second chunk is in its round, before its pieces
    w.push("B", FakeStream("b"), list(range(13)))  # B's first chunk on the lane; its second waits for the thread
    collect(w, lambda o: [k for k, _, _ in o] == ["B"])
    w.lm_ramping = True
    dec.gate.set()
    paused.wait(1, "looks that pause the round")
    assert w.take_results() == []  # A's round paused: B has 10 s ahead
    now[0] = 9.7  # B (and A) now 0.3 s from the end of their audio
    got = collect(w, lambda o: len(o) == 2)
    assert [k for k, _, _ in got] == ["A", "B"] and dec.batches == [["a"], ["b"]]
    w.close()
