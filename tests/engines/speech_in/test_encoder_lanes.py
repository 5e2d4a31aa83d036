"""Speech encoder KV slots and lanes: slots returned and reserved, a pool growth without memory, urgent and held
calls side by side with a growth waiting for both, and a failing step giving its lane back."""

from __future__ import annotations

import threading

import pytest
import torch

from engines.speech_in import SpeechEncoder
from tests.engines.speech_in.encoder_helpers import (
    WAIT_S,
    EagerStepGraphs,
    StepGate,
    speech_like,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_kv_slots_are_returned(enc):
    import gc

    base = enc.runner.kv.in_use
    a, b, c = enc.open_stream(), enc.open_stream(), enc.open_stream()
    assert enc.runner.kv.in_use == base + 3
    a.push(speech_like(0.3))
    a.finalize()
    b.close()
    del c
    gc.collect()
    assert enc.runner.kv.in_use == base
    # A reused slot holds stale rows from its last owner; they must not leak into the new stream.
    pcm = speech_like(0.7, seed=5)
    assert enc.encode(pcm) == SpeechEncoder.load("tiny-random").encode(pcm)


def test_a_pool_growth_without_memory_changes_nothing_and_says_why(monkeypatch):
    """Every slot taken and no memory to grow: PoolFullError (server_busy) for the stream that asked, and the pool as it
    was (its CUDA graphs hold its tensors: a half-done growth would free tensors they still write), then a growth that
    can allocate goes ahead as before."""
    from engines.speech_in.slot_pool import PoolFullError

    e = SpeechEncoder.load("tiny-random", device="cpu")
    pool = e.runner.kv
    e.reserve(2)
    held = [e.open_stream() for _ in range(2)]
    first = speech_like(0.7, seed=2)
    codes = held[0].push(first[:4800])
    keys, values, gen = list(pool.keys), list(pool.values), pool.generation
    before = [t.clone() for t in keys]
    real_zeros, calls = torch.zeros, [0]

    def zeros(*args, **kwargs):  # the third layer tensor of the growth runs out
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.raises(PoolFullError, match=r"all 2 of the speech encoder's KV slots are in use, and growing the pool "
                                            r"to 4 needs [\d.]+ GiB more") as err:
        e.open_stream()
    assert err.value.code == "server_busy"
    assert pool.capacity == 2 and pool.generation == gen and pool.in_use == 2
    assert all(a is b for a, b in zip(pool.keys + pool.values, keys + values, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(pool.keys, before, strict=True))
    monkeypatch.setattr(torch, "zeros", real_zeros)
    third = e.open_stream()
    assert pool.capacity == 4 and all(torch.equal(a[:2], b[:2]) for a, b in zip(pool.keys, before, strict=True))
    pcm = speech_like(0.4, seed=3)
    fresh = SpeechEncoder.load("tiny-random")
    assert third.push(pcm) + third.finalize() == fresh.encode(pcm)
    # The growth copied the carried state (mel, conv and pooling tails, peak) of a stream in the middle of its audio.
    assert codes + held[0].push(first[4800:]) + held[0].finalize() == fresh.encode(first)


def test_reserved_kv_slots_serve_that_many_streams_without_growing():
    e = SpeechEncoder.load("tiny-random", device="cpu")
    pool = e.runner.kv
    e.reserve(3)
    assert pool.capacity == 3
    streams = [e.open_stream() for _ in range(3)]
    for s in streams:
        s.push(speech_like(0.2, seed=1))
    assert pool.capacity == 3 and pool.in_use == 3  # no growth (a growth copies every layer's cache)
    extra = e.open_stream()
    extra.push(speech_like(0.1))
    assert pool.capacity == 6  # the fourth doubles the pool
    e.reserve(2)
    assert pool.capacity == 6  # reserving less never shrinks


def test_slots_held_back_for_re_encodes_go_to_re_encodes_only():
    e = SpeechEncoder.load("tiny-random", device="cpu")
    pool = e.runner.kv
    e.reserve(2, reencodes=1)
    assert pool.capacity == 3
    speakers = [e.open_stream() for _ in range(2)]
    again = e.open_stream(reencode=True)  # a re-encode takes the slot held back
    assert pool.capacity == 3 and pool.in_use == 3
    again.close()
    third = e.open_stream()  # a speaker does not: the pool grows (on a full GPU: PoolFullError, server_busy)
    assert pool.capacity == 6 and third.trunk.slot not in [s.trunk.slot for s in speakers]


class CountedLanes(threading.Condition):
    """The encoder's `_lanes` condition, counting the threads blocked in it: a test waits until a call or a growth
    of the pool waits for its turn there, instead of sleeping and seeing that it has not finished."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked = 0
        self._changed = threading.Condition()  # (taken with ours held, never the other way round)

    def wait(self, timeout=None):
        with self._changed:
            self.blocked += 1
            self._changed.notify_all()
        try:
            return super().wait(timeout)
        finally:
            with self._changed:
                self.blocked -= 1

    def until_blocked(self, n: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.blocked >= n, WAIT_S), f"{n} waiting, {self.blocked} came"


def _in_thread(fn, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t


def test_an_urgent_call_runs_beside_a_held_call_in_flight_and_a_growth_waits_for_both(enc, monkeypatch):
    """The encoder's two lanes: a commit's call (urgent) runs while a call of held audio is in flight; a growth of
    the KV pool (which moves every stream's rows) waits until no call is in flight, and no call starts meanwhile.
    Codes equal each stream alone."""
    e = SpeechEncoder.load("tiny-random", device="cpu")
    e.reserve(2)
    held, urgent = e.open_stream(), e.open_stream()
    pcm_h, pcm_u = speech_like(0.6, seed=51), speech_like(0.5, seed=52)
    gate = StepGate(monkeypatch, e)
    lanes = CountedLanes()
    monkeypatch.setattr(e, "_lanes", lanes)
    held_out: list = []
    t_held = _in_thread(lambda: e.batch(urgent=False).step([(held, pcm_h)]), held_out)
    assert gate.inside.wait(WAIT_S)
    assert e.batch().step([(urgent, pcm_u[:4000])]) == [enc.open_stream().push(pcm_u[:4000])]  # not waiting
    opened: list = []
    t_open = _in_thread(e.open_stream, opened)  # both slots taken: the pool must grow
    lanes.until_blocked(1)
    assert e._growing == 1 and opened == [] and e.runner.kv.capacity == 2  # waiting for the held call
    urgent_out: list = []
    t_urgent = _in_thread(lambda: e.batch().finalize([urgent], [pcm_u[4000:]]), urgent_out)
    lanes.until_blocked(2)
    assert urgent_out == [] and t_urgent.is_alive()  # a call does not start while a growth waits
    gate.gate.set()
    for t in (t_held, t_open, t_urgent):
        t.join(WAIT_S)
    assert e.runner.kv.capacity == 4 and len(opened) == 1
    alone = enc.open_stream()
    assert held_out == [[alone.push(pcm_h)]]
    alone.close()
    assert e.batch().finalize([held])[0] == enc.encode(pcm_h)[len(held_out[0][0]):]
    u_alone = enc.open_stream()
    u_alone.push(pcm_u[:4000])
    assert urgent_out == [[u_alone.finalize(pcm_u[4000:])]]
    opened[0].close()
    assert e.runner.kv.in_use == 0


def test_a_held_step_small_enough_for_the_urgent_graphs_goes_in_their_lane():
    """A held step of no more streams than the urgent graphs hold may replay them, so it waits for an urgent call in
    flight (one replay of a graph at a time); a bigger one runs beside it, and so does a small one once a growth of
    the pool has retired the graphs."""
    e = SpeechEncoder.load("tiny-random", device="cpu")
    e.reserve(8)
    e.runner.graphs = EagerStepGraphs(e.runner, 2)
    e.runner.graphs.capture()

    def busy_lane(urgent: bool, streams: int) -> set[str]:
        with e._lane(urgent, streams):
            return set(e._busy)

    assert [busy_lane(False, 2), busy_lane(False, 3), busy_lane(True, 3)] == [{"urgent"}, {"held"}, {"urgent"}]
    with pytest.MonkeyPatch.context() as mp:
        gate = StepGate(mp, e, urgent=True)
        streams = [e.open_stream() for _ in range(6)]
        lanes = CountedLanes()
        mp.setattr(e, "_lanes", lanes)
        pcm = speech_like(0.4, seed=53)
        outs: list[list] = [[], [], []]
        t_urgent = _in_thread(lambda: e.batch().step([(streams[0], pcm)]), outs[0])
        assert gate.inside.wait(WAIT_S)
        t_small = _in_thread(lambda: e.batch(urgent=False).step([(s, pcm) for s in streams[1:3]]), outs[1])
        t_big = _in_thread(lambda: e.batch(urgent=False).step([(s, pcm) for s in streams[3:6]]), outs[2])
        t_big.join(WAIT_S)
        lanes.until_blocked(1)  # the small step waits for the urgent lane
        assert outs[2] and t_small.is_alive() and not outs[1]
        gate.gate.set()
        t_urgent.join(WAIT_S)
        t_small.join(WAIT_S)
    alone = SpeechEncoder.load("tiny-random", device="cpu").open_stream().push(pcm)
    assert outs == [[[alone]], [[alone] * 2], [[alone] * 3]]
    assert e.runner.graphs.replays > 0
    more = [e.open_stream() for _ in range(3)]  # 9 streams: the pool grows, the graphs hold its old tensors
    assert e._lane_of(False, 2) == "held" and e._lane_of(True, 1) == "urgent"
    for s in streams + more:
        s.close()


def test_a_step_that_fails_gives_its_lane_back(monkeypatch):
    e = SpeechEncoder.load("tiny-random", device="cpu")
    s = e.open_stream()

    def broken(*_a, **_k):
        raise RuntimeError("the device failed")

    with monkeypatch.context() as mp:
        mp.setattr(e.runner, "run", broken)
        for urgent in (True, False):
            with pytest.raises(RuntimeError, match="the device failed"):
                e.batch(urgent).step([(s, speech_like(0.2))])
    assert e._busy == set()
    assert e.batch().step([(s, speech_like(0.2))]) == [SpeechEncoder.load("tiny-random").open_stream().push(
        speech_like(0.2))]
