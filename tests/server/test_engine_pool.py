"""Where a new session goes: the engine with the most headroom, from the free share of its pools (the KV pool, and
the speech decoder's cache when it reports one), its load and its step time."""

from __future__ import annotations

from server.engine_pool import headroom


def test_the_scarcer_of_the_two_pools_bounds_the_headroom():
    roomy = {"kv_free": 900, "kv_total": 1000, "decoder_pages_free": 900, "decoder_pages_total": 1000}
    decoder_full = {**roomy, "decoder_pages_free": 50}
    kv_full = {**roomy, "kv_free": 50}
    assert headroom(decoder_full, 0) == headroom(kv_full, 0) < headroom(roomy, 0)
    assert headroom(roomy, 0) == headroom({"kv_free": 900, "kv_total": 1000}, 0)  # no decoder cache reported: KV only


def test_load_and_slow_steps_lower_it():
    st = {"kv_free": 500, "kv_total": 1000}
    assert headroom(st, 3) < headroom(st, 0)
    assert headroom({**st, "running": 3}, 0) == headroom(st, 3)
    assert headroom({**st, "step_ms": 20.0}, 0) < headroom(st, 0)
