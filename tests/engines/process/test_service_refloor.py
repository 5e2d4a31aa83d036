"""A committed user turn holds the codes of its whole-segment log-mel features (the reference's floor), not those of
the running floor it streamed with: the engine service rewrites them in the conversation, while the turn is spoken
as its max rises and at the commit for a rise in its last audio (real tiny engine and speech encoder, the fake
decoder), a withdrawn and continued turn too, and one undone by a truncation while those changes come; a turn whose
first frame is its loudest is prefilled once; a turn longer than a 30 s segment has each segment redone as it passes
its end."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engines.audio.wav import float32_to_pcm16
from engines.process.prompt import PromptBuilder
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.profiling.log_mel_codes import _encoder
from engines.protocol import messages as m
from engines.speech_in import ENCODER_PRESETS, SpeechEncoder
from tests.engines.process.fake_service import FakeDecoder, greedy, make_service, of, run, send
from tests.engines.speech_in.encoder_helpers import speech_en, whole_segment_codes

PB = PromptBuilder(StandInTokenizer())


def service(enc: SpeechEncoder) -> Service:
    svc = make_service()
    return Service(svc.engine, StandInTokenizer(), enc, FakeDecoder())


def speak(svc: Service, pcm: np.ndarray) -> None:
    raw = float32_to_pcm16(pcm)
    for i in range(0, len(raw), 1280):  # 40 ms pieces, the engine stepping between them
        send(svc, m.AppendUserAudio("s", raw[i:i + 1280]))
        run(svc)


def answer(svc: Service, rid: str) -> m.ResponseDone:
    send(svc, m.CommitUserAudio("s", "item"))
    send(svc, m.CreateResponse("s", rid, "audio", greedy(6, min_new=6)))
    out = run(svc)
    assert not of(out, m.Error)
    return of(out, m.ResponseDone)[0]


def assert_turn_holds(svc: Service, codes: list[int]) -> None:
    prompt = PB.system_rows(None, "audio") + PB.user_audio_turn_rows(codes) + PB.assistant_prefix_rows("audio")
    assert svc.engine.conversation_history("s")[:len(prompt)] == prompt


def assert_books_balance(svc: Service) -> None:
    eng = svc.engine
    eng.check_integrity()
    send(svc, m.CloseSession("s"))
    assert eng.stats().free_blocks == eng.stats().total_blocks
    eng.check_integrity()


def test_a_quiet_start_turn_holds_its_whole_segment_codes_before_its_commit(enc):
    """Its max rises while it is spoken: its rows are rewritten then (the encoder rewinds its stream), so that at the
    commit only the last code, the closing rows and the assistant prefix are left to prefill."""
    pcm = speech_en(2.5)  # its max rises up to 1.9 s
    ref = whole_segment_codes(enc, pcm)
    assert enc.encode(pcm) != ref  # what the running floor gives
    svc = service(enc)
    send(svc, m.OpenSession("s", sampling=greedy(6, min_new=6)))
    speak(svc, pcm)
    before = svc.engine.stats().prefilled_rows
    sent = list(svc.sessions["s"].active.codes)
    assert sent == ref[:len(sent)] and len(sent) >= len(ref) - 1
    done = answer(svc, "r")
    assert_turn_holds(svc, ref)
    tail = len(ref) - len(sent) + len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    assert svc.engine.stats().prefilled_rows - before == tail
    assert done.prompt_rows == len(PB.system_rows(None, "audio") + PB.user_audio_turn_rows(ref)
                                   + PB.assistant_prefix_rows("audio"))
    assert_books_balance(svc)


def test_a_turn_whose_max_rises_in_its_last_audio_is_rewritten_at_its_commit(enc):
    """A click in its last 6 ms (framed only by the commit's finalize) raises its max: the commit re-encodes the
    turn, and the rows it holds are prefilled again from the first code that changed."""
    pcm = speech_en(2.5)
    pcm[-100:] += 0.9
    ref = whole_segment_codes(enc, pcm)
    svc = service(enc)
    send(svc, m.OpenSession("s", sampling=greedy(6, min_new=6)))
    speak(svc, pcm)
    before = svc.engine.stats().prefilled_rows
    sent = list(svc.sessions["s"].active.codes)
    first = next(i for i, (a, b) in enumerate(zip(sent, ref, strict=False)) if a != b)
    answer(svc, "r")
    assert_turn_holds(svc, ref)
    tail = len(ref) - len(sent) + len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    assert svc.engine.stats().prefilled_rows - before == len(sent) - first + tail  # rewritten from its first change
    assert_books_balance(svc)


def test_a_turn_whose_first_frame_is_its_loudest_is_prefilled_once(enc):
    pcm = speech_en(1.5) * 0.05
    pcm[:40] += 0.9  # a click under the first frame's window centre only
    ref = whole_segment_codes(enc, pcm)
    assert enc.encode(pcm) == ref
    svc = service(enc)
    send(svc, m.OpenSession("s", sampling=greedy(6, min_new=6)))
    speak(svc, pcm)
    before = svc.engine.stats().prefilled_rows
    sent = len(svc.sessions["s"].active.codes)
    answer(svc, "r")
    assert_turn_holds(svc, ref)
    tail = len(ref) - sent + len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    assert svc.engine.stats().prefilled_rows - before == tail
    assert_books_balance(svc)


# The user goes on speaking after the withdrawal; or commits at once, and a click in the audio that a tentative
# commit leaves for the next code (its frames wait for the samples after it) raises the turn's max.
@pytest.mark.parametrize("more", [True, False])
def test_a_withdrawn_and_continued_turn_holds_the_codes_of_all_of_it(enc, more):
    pcm = speech_en(2.5)
    if not more:
        pcm[-100:] += 0.9
    cut = 1.01 if more else 2.5
    first, rest = pcm[: int(cut * 16000)], pcm[int(cut * 16000):]
    svc = service(enc)
    send(svc, m.OpenSession("s", sampling=greedy(6, min_new=6)))
    speak(svc, first)
    send(svc, m.CommitUserAudio("s", "item", tentative=True))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(6, min_new=6)))
    t = svc.sessions["s"].active
    start = t.base_rows + t.user_rows_start + len(PB.audio_turn_open_rows())
    held = svc.engine.live_request(t.request_id).rows[start:start + len(t.codes)]
    so_far = PB.audio_code_rows(whole_segment_codes(enc, first)[:len(t.codes)])
    # The tentative turn's codes determined so far are those of its whole-segment features so far (with the click,
    # the frames that would raise the max wait for the samples after it).
    assert (held == so_far) == more
    svc.step()
    send(svc, m.WithdrawResponse("s", "r0"))
    run(svc)
    speak(svc, rest)
    answer(svc, "r1")
    assert_turn_holds(svc, whole_segment_codes(enc, pcm))
    assert_books_balance(svc)


def test_a_turn_longer_than_a_segment_is_redone_a_segment_at_a_time():
    cfg = dataclasses.replace(ENCODER_PRESETS["tiny-random"], max_source_positions=52)  # 1.04 s segments, 13 codes
    enc = _encoder(cfg, seed=1)
    pcm = speech_en(3.7)
    ref = whole_segment_codes(enc, pcm)
    svc = service(enc)
    send(svc, m.OpenSession("s", sampling=greedy(6, min_new=6)))
    speak(svc, pcm)
    sent = list(svc.sessions["s"].active.codes)
    done = enc.segments_done(pcm.size) * cfg.codes_per_segment
    assert done == 39 and sent[:done] == ref[:done]  # the segments the turn has passed: redone while it was spoken
    assert svc._speech.take_spans()["encode refloor held"][0] == 3
    before = svc.engine.stats().prefilled_rows
    answer(svc, "r")
    assert_turn_holds(svc, ref)
    tail = len(ref) - len(sent) + len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    redone = svc.engine.stats().prefilled_rows - before - tail
    assert 0 < redone <= len(sent) - done  # at the commit, only the last segment's codes
    assert_books_balance(svc)


def test_a_turn_undone_by_a_barge_in_truncation_keeps_what_its_rewinds_changed(enc):
    """The user barges in (a new turn under way) and the client then truncates the answer it cut: the open turn is
    undone and prefilled again. Re-encodes that arrive before the undo completes change the codes it puts back, so
    the committed turn still holds its whole-segment codes."""
    loud = speech_en(2.5)[8000:24000]  # a louder stretch: the first answer's turn
    pcm = speech_en(2.5)
    cut = 28800
    pcm[cut:cut + 3200] *= 2  # its max rises last there, in the audio after the truncation
    ref = whole_segment_codes(enc, pcm)
    svc = service(enc)
    send(svc, m.OpenSession("s", sampling=greedy(6, min_new=6)))
    speak(svc, loud)
    answer(svc, "r0")
    speak(svc, pcm[:cut])
    send(svc, m.TruncateResponse("s", "r0", 2 * 1920))
    svc._speech.take_spans()
    send(svc, m.AppendUserAudio("s", float32_to_pcm16(pcm[cut:cut + 3200])))  # encoded before the next step
    assert svc.sessions["s"].active.undo == "requeue" and "encode rewind" in svc._speech.take_spans()
    speak(svc, pcm[cut + 3200:])
    answer(svc, "r1")
    history = svc.engine.conversation_history("s")
    turn = PB.user_audio_turn_rows(ref)
    assert any(history[i:i + len(turn)] == turn for i in range(len(history) - len(turn) + 1))
    assert_books_balance(svc)


def test_a_withdrawn_turn_is_encoded_again_while_the_user_goes_on(enc):
    """After a tentative commit the turn's floor waits (its answer may be under way); once that answer is withdrawn
    and the user goes on, rises of its max are redone while spoken again, so the final commit prefills only its
    tail."""
    pcm = speech_en(2.5)  # its max rises again at 1.01-1.9 s
    first, rest = pcm[:16000], pcm[16000:]
    svc = service(enc)
    send(svc, m.OpenSession("s", sampling=greedy(6, min_new=6)))
    speak(svc, first)
    send(svc, m.CommitUserAudio("s", "item", tentative=True))
    send(svc, m.CreateResponse("s", "r0", "audio", greedy(6, min_new=6)))
    svc.step()
    send(svc, m.WithdrawResponse("s", "r0"))
    run(svc)
    speak(svc, rest)
    before = svc.engine.stats().prefilled_rows
    sent = len(svc.sessions["s"].active.codes)
    ref = whole_segment_codes(enc, pcm)
    answer(svc, "r1")
    assert_turn_holds(svc, ref)
    tail = len(ref) - sent + len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    assert svc.engine.stats().prefilled_rows - before == tail
    assert_books_balance(svc)
