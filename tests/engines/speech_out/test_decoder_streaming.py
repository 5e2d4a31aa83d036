"""Streaming codec decoder on tiny random weights: a stream fed in any pieces equals one fed all at once, the offline
model's lengths, short and odd lengths, seams, seeds, batches of voices and of sessions at different points equal each
alone, the windowed flow's per-round ops and bounded state, bad codes."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from engines.bench.codec_rounds import SteadyRounds
from engines.speech_out import BadCodesError, CodecDecoder, Voice
from tests.engines.speech_out.decoder_rounds import BATCH_TOL, SPC, STREAM_TOL, _codes, _stream, in_rounds

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("vocoder", ["hift", "bigvgan"])
def test_streamed_in_any_pieces_equals_all_at_once_and_length(vocoder, hift_dec, bigvgan_dec):
    dec = hift_dec if vocoder == "hift" else bigvgan_dec
    codes = _codes(27)
    whole = dec.stream_all(codes, seed=7)
    assert whole.shape == (27 * SPC,) and whole.dtype == np.float32
    assert np.isfinite(whole).all() and np.abs(whole).max() > 1e-4  # not silence
    streamed = np.concatenate(_stream(dec, codes, [1, 4, 2, 7, 3], seed=7))
    np.testing.assert_allclose(streamed, whole, atol=STREAM_TOL, rtol=0)
    # Nothing comes out before the first chunk's 5 + 3 codes; then 9600 samples per chunk minus the held tail.
    first = dec.open_stream("f", seed=7)
    assert first.push(codes[:7]).size == 0
    assert first.push(codes[7:8]).size == 5 * SPC - 2 * 480
    first.close()


def test_offline_model_attends_ahead_so_differs_from_the_stream(hift_dec):
    codes = _codes(27)
    offline = hift_dec.decode(codes, seed=7)
    assert offline.shape == (27 * SPC,) and np.isfinite(offline).all()
    assert np.abs(offline - hift_dec.stream_all(codes, seed=7)).max() > 1e-4


@pytest.mark.parametrize("n", [1, 4, 5, 8, 13])
def test_short_and_odd_lengths(hift_dec, n):
    out = hift_dec.decode(_codes(n, seed=n), seed=1)
    assert out.shape == (n * SPC,)
    assert hift_dec.decode([], seed=1).shape == (0,)


@pytest.mark.parametrize("prompt_codes", [40, 41, 42, 43, 44])  # prompt tails of 5, 6, 7, 3 and 4 codes
@pytest.mark.parametrize("context", ["full", "window"])
def test_first_audio_waits_for_exactly_first_audio_codes(hift_dec, window_dec, context, prompt_codes):
    """What the engine and the codec worker wait for before an answer's first audio (its ramp) is what the stream
    needs: its first job comes with its `first_audio_codes`-th code, not one code sooner. Under full context that
    is the first job past the prompt's tail and its lookahead (8-12 codes); windowed, a chunk and its lookahead."""
    dec = hift_dec if context == "full" else window_dec
    s = dec.open_stream("first", voice=Voice.random(seed=2, n_codes=prompt_codes))
    try:
        want = {0: 8, 1: 12, 2: 11, 3: 10, 4: 9}[prompt_codes % 5] if context == "full" else 8
        assert s.first_audio_codes == want
        for k in range(1, want):
            s.add([k])
            assert not s.take_jobs(), k
        s.add([want])
        assert s.take_jobs()
    finally:
        s.close()


def test_seams_no_worse_than_signal(hift_dec):
    codes = _codes(43, seed=3)
    parts = _stream(hift_dec, codes, [5], seed=2)
    y = np.concatenate(parts)
    jumps = np.abs(np.diff(y))
    seams = np.cumsum([p.size for p in parts if p.size])[:-1]  # first sample of each new piece
    seam_jumps = jumps[seams - 1]
    assert seam_jumps.max() <= jumps.max()
    # A crossfade region must not be a discontinuity either: compare to the typical jump in the signal.
    assert seam_jumps.max() <= np.quantile(jumps, 0.999)


def test_same_seed_same_pcm_and_seed_matters(hift_dec):
    codes = _codes(16, seed=5)
    a = hift_dec.decode(codes, seed=11)
    b = hift_dec.decode(codes, seed=11)
    c = hift_dec.decode(codes, seed=12)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-4


def test_batch_equals_alone_with_different_voices(hift_dec):
    voices = [None, Voice.random(seed=5, n_codes=3), Voice.random(seed=6, n_codes=11), Voice.empty()]
    lengths = [13, 27, 9, 21]
    codes = [_codes(n, seed=20 + i) for i, n in enumerate(lengths)]
    alone = [hift_dec.stream_all(c, voice=v, seed=i) for i, (c, v) in enumerate(zip(codes, voices, strict=True))]
    streams = []
    for i, (c, v) in enumerate(zip(codes, voices, strict=True)):
        streams.append(hift_dec.open_stream(f"s{i}", voice=v, seed=i))
        streams[-1].add(c)
    got, batch_sizes = in_rounds(hift_dec, streams)
    assert max(batch_sizes) == 4  # really decoded together
    for i in range(4):
        y = got[i]
        assert y.shape == (lengths[i] * SPC,)
        np.testing.assert_allclose(y, alone[i], atol=BATCH_TOL, rtol=0)


def test_random_voices_of_one_seed_and_other_lengths_are_cached_apart(hift_dec):
    """The decoder caches prepared voices by name, so two random voices of one seed but other prompt lengths must not
    share one (the second decoded with the first's prompt)."""
    a, b = Voice.random(seed=12, n_codes=4), Voice.random(seed=12, n_codes=9)
    assert hift_dec.prepared(a).mel.shape[1] == 4 * 4 and hift_dec.prepared(b).mel.shape[1] == 4 * 9


def test_batch_of_sessions_at_different_points_equals_each_alone(window_dec):
    """Sessions that start rounds apart have windows of different lengths in one batch (and two voices,
    interleaved): run_jobs orders them into runs (FlowModel._runs); each still gets its own PCM."""
    voices = [None, Voice.random(seed=8, n_codes=4)]
    n = 6
    codes = [_codes(5 * (3 + i % 4), seed=70 + i) for i in range(n)]
    alone = [window_dec.stream_all(c, voice=voices[i % 2], seed=i) for i, c in enumerate(codes)]
    queues: list[deque] = [deque() for _ in range(n)]
    got: list[list[np.ndarray]] = [[] for _ in range(n)]
    runs_seen = []
    runs = window_dec.flow._runs
    window_dec.flow._runs = lambda states: runs_seen.append(r := runs(states)) or r
    try:
        for rnd in range(12):
            for i in range(n):
                if rnd == i % 3:  # starts staggered by a round: windows of 0, 5 and 10 codes side by side
                    s = window_dec.open_stream(f"s{i}", voice=voices[i % 2], seed=i)
                    s.add(codes[i])
                    queues[i].extend(s.take_jobs(finishing=True))
            idx = [i for i, q in enumerate(queues) if q]
            if idx:
                for i, pcm in zip(idx, window_dec.run_jobs([queues[i].popleft() for i in idx]), strict=True):
                    got[i].append(pcm)
    finally:
        del window_dec.flow._runs  # the class's own again
    assert not any(queues)
    assert max(len(r) for r in runs_seen) >= 4  # really mixed: several (voice, window) runs in one batch
    for i in range(n):
        np.testing.assert_allclose(np.concatenate(got[i]), alone[i], atol=BATCH_TOL, rtol=0)


def _steady_round_ops(dec: CodecDecoder, batch: int, voices: list) -> dict[str, int]:
    """Torch ops (views left out) of one steady-state round of `batch` sessions with full encoder windows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "_unsafe_view", "slice", "select", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze",
             "alias", "as_strided", "detach", "empty", "split", "unbind", "reshape", "narrow", "lift_fresh"}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in views:
                self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    rounds = SteadyRounds(dec, batch, voices=voices)
    for _ in range(dec.cfg.stream.steady_chunks):  # until every window is full
        rounds.feed()
        assert len(rounds.decode()) == batch
    rounds.feed()
    with Count() as c:
        assert len(rounds.decode()) == batch
    rounds.close()
    return c.ops


def test_round_ops_grow_with_the_batch_only_by_each_sessions_noise_draws(window_dec):
    """Per-session host work of a round is its own RNG draws (the flow's noise and HiFT's source noise); keys, windows
    and seams go as one op per run of sessions with the same voice (~25 us of host time per op on a GPU, held with
    the GIL by the codec's thread while the engine loop waits for it). Sessions of two voices, interleaved, are
    ordered into two runs."""
    voices = [None, Voice.random(seed=7, n_codes=6)]
    small, large = _steady_round_ops(window_dec, 4, voices), _steady_round_ops(window_dec, 8, voices)
    grown = {k: large.get(k, 0) - small.get(k, 0) for k in set(small) | set(large)}
    assert {k: v for k, v in grown.items() if v} == {"randn": 2 * (8 - 4)}


def test_state_is_bounded(window_dec):
    s = window_dec.open_stream("b", seed=0)
    sizes = []
    for i in range(12):
        s.push(_codes(5, seed=100 + i))
        sizes.append(s.state_bytes())
    enc_left = window_dec.cfg.stream.enc_left_chunks
    assert len(set(sizes[enc_left + 1:])) == 1  # constant once the attention window is full
    assert s.flow_state.win_kv.shape[2] == enc_left * 5


@pytest.mark.parametrize("bad", [[1, 16384], [-1, 3], np.array([1.0, 2.0]), [[1, 2], [3, 4]], [True, False]])
def test_bad_codes_refused(hift_dec, bad):
    s = hift_dec.open_stream("x")
    with pytest.raises(BadCodesError) as e:
        s.push(bad)
    assert isinstance(e.value, ValueError)
    with pytest.raises(BadCodesError):
        hift_dec.decode(bad)
