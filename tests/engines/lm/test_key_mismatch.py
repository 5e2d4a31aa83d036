"""engines.lm.loader.mismatch: the phrases a loader's error is made of (the codec decoder's and the speech
encoder's)."""

from engines.lm.loader.mismatch import key_mismatches


def test_every_kind_of_mismatch_is_named_with_its_count_and_agreeing_keys_give_none():
    want = {"a": (2, 3), "b": (4,), "c": (1,)}
    assert key_mismatches(want, dict(want)) == []
    got = {"a": (3, 2), "b": (4,), "x": (1,), "skip.me": (5,)}
    assert key_mismatches(want, got, ignored=lambda k: k.startswith("skip.")) == [
        "missing 1: ['c']", "unexpected 1: ['x']", "wrong shape 1: ['a: (3, 2) != expected (2, 3)']"]


def test_long_lists_are_cut_with_their_count_kept():
    got = {f"k{i:02d}": (1,) for i in range(25)}
    (phrase,) = key_mismatches({}, got, most=3)
    assert phrase == "unexpected 25: ['k00', 'k01', 'k02'] ..."
