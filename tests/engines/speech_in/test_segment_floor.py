"""A committed turn re-encoded with the log-mel floor over each whole segment (segment_floor.py): its codes are those
of the dense whole-segment features swapped into the same trunk (the profiling tool's swap), and it changes nothing
when the running floor already was the segment's."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from engines.profiling.log_mel_codes import _encoder
from engines.speech_in import ENCODER_PRESETS, SpeechEncoder, segment_floor
from engines.speech_in.segment_floor import RefloorJob
from tests.engines.speech_in.encoder_helpers import speech_en, whole_segment_codes


def committed(enc: SpeechEncoder, pcm: np.ndarray, final: bool = True) -> tuple[list[int], int | None]:
    if final:
        codes = enc.encode(pcm)
    else:
        s = enc.open_stream()
        codes = s.push(pcm)
        s.close()
    r = enc.refloor(pcm, final)
    return (codes, None) if r is None else (codes[: r.first] + r.codes, r.first)


def test_a_quiet_start_takes_the_whole_segment_floor(enc):
    pcm = speech_en(2.5)  # its first ~0.4 s are quiet
    codes, first = committed(enc, pcm)
    ref = whole_segment_codes(enc, pcm)
    assert codes == ref and len(codes) == enc.codes_for_samples(pcm.size)
    assert enc.encode(pcm) != ref  # as streamed, the running floor gives other codes
    assert first == 0


def test_nothing_is_redone_when_the_first_frame_is_the_loudest(enc):
    pcm = speech_en(1.5) * 0.05
    pcm[:40] += 0.9  # a click under the first frame's window centre only
    assert enc.refloor(pcm, final=True) is None
    assert enc.encode(pcm) == whole_segment_codes(enc, pcm)


def test_a_tentative_commit_refloors_the_codes_determined_so_far(enc):
    pcm = speech_en(2.03)  # the last 30 ms wait for more audio (or the final commit)
    codes, _ = committed(enc, pcm, final=False)
    whole, _ = committed(enc, pcm)
    assert 0 < len(codes) < len(whole) and codes == whole[: len(codes)]


@pytest.mark.parametrize("seconds", [4.2, 3.95])
def test_each_segment_takes_its_own_floor(seconds):
    # 1 s segments: a 4.2 s turn has five, each with its own max; the streams of the re-encode start mid-turn.
    cfg = dataclasses.replace(ENCODER_PRESETS["tiny-random"], max_source_positions=52)
    enc = _encoder(cfg, seed=1)
    pcm = speech_en(seconds)
    codes, first = committed(enc, pcm)
    assert codes == whole_segment_codes(enc, pcm) and len(codes) == enc.codes_for_samples(pcm.size)
    assert first is not None and codes != enc.encode(pcm)


def test_segments_redone_as_the_turn_passes_them_add_up_to_the_whole_turn():
    cfg = dataclasses.replace(ENCODER_PRESETS["tiny-random"], max_source_positions=52)  # 1.04 s segments
    enc = _encoder(cfg, seed=1)
    pcm = speech_en(3.7)
    codes = enc.encode(pcm)
    done = 0
    for k in (17000, 20000, 40000, 52000):  # the turn so far, as held calls end
        passed = enc.segments_done(k)
        r = enc.refloor(pcm[:k], False, done, passed, urgent=False) if passed > done else None
        if r is not None:
            assert r.first >= done * cfg.codes_per_segment and r.first + len(r.codes) <= passed * cfg.codes_per_segment
            codes[r.first:r.first + len(r.codes)] = r.codes
        done = passed
    assert done == 3
    r = enc.refloor(pcm, True, done)
    assert r is not None and r.first >= 3 * cfg.codes_per_segment and r.total == len(codes)
    assert codes[: r.first] + r.codes == whole_segment_codes(enc, pcm)


def test_turns_redone_in_one_call_get_what_each_gets_alone():
    cfg = dataclasses.replace(ENCODER_PRESETS["tiny-random"], max_source_positions=52)  # 1.04 s segments
    enc = _encoder(cfg, seed=1)
    loud = speech_en(0.8) * 0.05
    loud[:40] += 0.9  # one segment, its first frame the loudest: nothing to redo
    jobs = [RefloorJob(speech_en(3.7), True), RefloorJob(loud, True), RefloorJob(speech_en(2.5)[:30000], False),
            RefloorJob(speech_en(3.7), True, 2), RefloorJob(speech_en(3.7)[:40000], False, 0, 2)]
    alone = [enc.refloor(j.pcm, j.final, j.first_segment, j.end_segment) for j in jobs]
    assert enc.refloor_many(jobs) == alone
    assert alone[1] is None and sum(r is not None for r in alone) == 4
    assert enc.runner.kv.in_use == 0


@pytest.mark.parametrize("urgent", [True, False])
def test_a_re_encode_runs_on_its_calls_stream_frame_maxima_included(enc, monkeypatch, urgent):
    # A commit's re-encode (urgent) waits for its frame maxima: on a thread's default stream they would run at the
    # least priority.
    active: list[bool] = []
    seen: list[list[bool]] = []

    @contextlib.contextmanager
    def on_stream(urgent: bool = True):
        active.append(urgent)
        try:
            yield
        finally:
            active.pop()

    peaks = segment_floor.frame_peaks

    def recording_peaks(encoder, xs):
        seen.append(list(active))
        return peaks(encoder, xs)

    monkeypatch.setattr(enc, "_on_stream", on_stream)
    monkeypatch.setattr(segment_floor, "frame_peaks", recording_peaks)
    pcm = speech_en(2.5)
    assert enc.refloor(pcm, True, urgent=urgent) is not None
    assert enc.refloor_many([RefloorJob(pcm, True), RefloorJob(pcm[:30000], False)], urgent=urgent)[0] is not None
    assert seen == [[urgent]] * 2  # one pass for all the turns of a call


def test_the_frame_maxima_of_several_turns_in_one_pass_are_each_turns_own():
    cfg = dataclasses.replace(ENCODER_PRESETS["tiny-random"], max_source_positions=52)  # 1.04 s segments
    enc = _encoder(cfg, seed=1)
    xs = [speech_en(2.5), speech_en(0.3)[:100], speech_en(1.7), np.zeros(0, np.float32), speech_en(0.9)]
    together = segment_floor.frame_peaks(enc, xs)
    alone = [segment_floor.frame_peaks(enc, [x])[0] for x in xs]
    # frame t is whole once sample 160 t + 200 is in
    assert [p.size for p in together] == [p.size for p in alone] == [249, 0, 169, 0, 89]
    assert all(np.array_equal(a, b) for a, b in zip(together, alone, strict=True))


def test_a_rewound_stream_goes_on_with_its_segments_max_as_its_floor(enc):
    """A speaking turn's own stream, rewound (RefloorJob.stream): the codes so far are those a re-encode of its own
    would make, and the stream goes on from there with that floor: once the max stops rising, the commit has
    nothing to redo, and the turn's codes are the whole-segment ones."""
    pcm = speech_en(2.5)  # its max rises up to 1.9 s
    k = 32000
    s = enc.open_stream()
    codes = s.push(pcm[:k])
    r = enc.refloor_many([RefloorJob(pcm[:k], False, stream=s)], urgent=False)[0]
    assert r == enc.refloor(pcm[:k], final=False) and s.floor_from[0] == 0
    codes = r.apply(codes) + s.finalize(pcm[k:])
    assert enc.refloor_many([RefloorJob(pcm, True, rewound=s.floor_from)]) == [None]
    assert codes == whole_segment_codes(enc, pcm)


def test_only_a_turns_open_stream_with_all_its_audio_can_be_rewound(enc):
    s = enc.open_stream()
    s.push(speech_en(0.5))
    for bad in ({"final": True}, {"final": False, "end_segment": 1}):
        with pytest.raises(ValueError, match="rewound"):
            RefloorJob(speech_en(0.5), stream=s, **bad)
    with pytest.raises(ValueError, match="samples"):
        enc.refloor_many([RefloorJob(speech_en(0.6), False, stream=s)])
    s.close()
