"""Load test statistics without a server: percentiles and their confidence interval, summaries, the playback
buffer's underrun accounting, and the decoded size of base64 audio."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from moss_speech.loadtest.stats import PlaybackBuffer, b64_decoded_len, percentile, percentile_interval, summarize


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(100.0, n).tolist()
        for q in (0, 50, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="in \\[0, 100\\]"):
        percentile([1.0], 101)


def test_summarize_ignores_none_and_reports_empty():
    s = summarize([None, 3.0, 1.0, 2.0])
    assert (s["count"], s["mean"], s["p50"], s["max"], s["p95_ci"]) == (3, 2.0, 2.0, 3.0, None)  # (too few for it)
    assert summarize([None]) == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None,
                                 "p95_ci": None}
    lo, hi = summarize(list(range(240)))["p95_ci"]
    assert lo <= percentile(range(240), 95) <= hi


def test_percentile_interval_ranks_come_from_the_binomial_tails():
    """Values 1..n, so each bound is its own rank: the lower one is the highest rank r with P(K <= r - 1) <= 5% and
    the upper one the lowest s with P(K <= s - 1) >= 95%, K ~ binomial(n, 0.95)."""
    from scipy.stats import binom

    for n in (59, 100, 240, 1000):
        lo, hi = percentile_interval(range(1, n + 1), 95)
        cdf = binom.cdf(np.arange(n), n, 0.95)  # cdf[r - 1] = P(K <= r - 1)
        assert lo == max(r for r in range(1, n + 1) if cdf[r - 1] <= 0.05)
        assert hi == min(s for s in range(1, n + 1) if cdf[s - 1] >= 0.95)
    assert percentile_interval(range(58), 95) is None  # p95 at 90% needs 59 draws
    assert percentile_interval([], 95) is None
    with pytest.raises(ValueError, match="percentile"):
        percentile_interval([1.0], 100)
    with pytest.raises(ValueError, match="confidence"):
        percentile_interval([1.0], 95, confidence=1.0)


def test_percentile_interval_covers_the_true_percentile_about_as_often_as_it_says():
    rng = np.random.default_rng(7)
    trials = 1000
    covered = sum(lo <= 0.95 <= hi for lo, hi in (percentile_interval(rng.random(240), 95) for _ in range(trials)))
    assert 0.88 <= covered / trials <= 0.97  # at least 90% by construction (ranks are whole: a little over)


def _play(schedule: list[tuple[float, float]], prebuffer_s: float = 0.0, done_at: float | None = None):
    """schedule: (arrival time, chunk seconds) at 24 kHz."""
    buf = PlaybackBuffer(prebuffer_s=prebuffer_s)
    for t, dur in schedule:
        buf.on_audio(t, round(dur * 24000))
    end = buf.finish(done_at if done_at is not None else schedule[-1][0])
    return buf, end


def test_playback_real_time_arrivals_never_underrun():
    # 400 ms chunks arriving every 400 ms: each lands exactly as the previous one finishes playing.
    buf, end = _play([(1.0 + 0.4 * i, 0.4) for i in range(10)])
    assert buf.underruns == 0 and buf.stall_s == 0
    assert buf.min_lead_s == pytest.approx(0.0, abs=1e-9)
    assert buf.started_at == 1.0 and end == pytest.approx(5.0)
    assert buf.audio_s == pytest.approx(4.0)


def test_playback_late_chunk_is_one_underrun_with_its_stall():
    # Chunk 3 arrives 150 ms after the buffer ran dry; chunk 4 is on time again relative to the resumed playback.
    buf, end = _play([(0.0, 0.4), (0.4, 0.4), (0.95, 0.4), (1.3, 0.4)])
    assert buf.underruns == 1
    assert buf.stall_s == pytest.approx(0.15)
    assert end == pytest.approx(0.95 + 0.8)


def test_playback_prebuffer_absorbs_jitter_that_would_underrun_without_it():
    # 20 ms frames sent at real time, every third one delayed by 30 ms; over TCP the ones behind it wait too.
    sched, t = [], 0.0
    for i in range(60):
        t = max(t, 0.02 * i + (0.03 if i % 3 == 2 else 0.0))
        sched.append((t, 0.02))
    no_buf, _ = _play(sched, prebuffer_s=0.0)
    with_buf, _ = _play(sched, prebuffer_s=0.06)
    assert no_buf.underruns > 0
    assert with_buf.underruns == 0
    assert with_buf.started_at == pytest.approx(0.07)  # the third (late) frame fills the 60 ms


def test_playback_starts_at_response_end_when_prebuffer_never_fills():
    buf, end = _play([(2.0, 0.02)], prebuffer_s=0.2, done_at=2.5)
    assert buf.started_at == 2.5 and end == pytest.approx(2.52) and buf.underruns == 0


def test_playback_nothing_received():
    buf = PlaybackBuffer()
    assert buf.finish(3.0) == 3.0 and buf.started_at is None and buf.underruns == 0


def test_playback_rejects_bad_input():
    with pytest.raises(ValueError):
        PlaybackBuffer(prebuffer_s=-1)
    with pytest.raises(ValueError):
        PlaybackBuffer().on_audio(0.0, -5)


def test_b64_decoded_len_matches_decoding():
    for n in range(0, 12):
        s = base64.b64encode(bytes(range(n))).decode()
        assert b64_decoded_len(s) == n
    with pytest.raises(ValueError):
        b64_decoded_len("abc")
