"""Session state machine of the engine service: real tiny Engine, small fakes of the codec (fake_service), whose
rows and samples the tests can count exactly."""

from __future__ import annotations

import ast
import logging

import numpy as np
import pytest

from engines.process.service import Service
from engines.protocol import messages as m
from engines.tokens import AUDIO_PAD, EOSP, IM_END, MODALITY_PAD, SOSP
from tests.engines.process import service_loop
from tests.engines.process.fake_service import (
    PB,
    C,
    FakeDecoderStream,
    FakeEncoderStream,
    greedy,
    make_service,
    of,
    run,
    send,
    speech,
)


def test_text_turn_then_second_turn_prefills_only_new_rows() -> None:
    svc = make_service()
    eng = svc.engine
    assert of(send(svc, m.OpenSession("s")), m.SessionReady)
    assert send(svc, m.AddUserText("s", "i1", "Hello")) == []
    started = send(svc, m.CreateResponse("s", "r1", "text", greedy(6)))
    first = PB.system_rows(None, "text") + PB.text_turn_rows("user", "Hello") + PB.assistant_prefix_rows("text")
    assert started == [m.ResponseStarted("s", "r1", len(first))]
    out = run(svc)
    done = of(out, m.ResponseDone)[0]
    assert done.status == "incomplete" and done.reason == "max_output_tokens"
    assert done.output_rows == 6 and done.prompt_rows == len(first) and done.cached_rows == 0
    assert "".join(d.text for d in of(out, m.TextDelta)) == done.text != ""
    assert not of(out, m.AudioChunk)
    hist = eng.conversation_history("s")
    assert hist[:len(first)] == first and len(hist) == len(first) + 6

    before = eng.stats().prefilled_rows
    send(svc, m.AddUserText("s", "i2", "More"))
    send(svc, m.CreateResponse("s", "r2", "text", greedy(3)))
    # The first answer was cut by length in text mode: it is closed with <|im_end|>\n.
    new = PB.assistant_close_rows(hist[-1]) + PB.text_turn_rows("user", "More") + PB.assistant_prefix_rows("text")
    assert PB.assistant_close_rows(hist[-1])[0] == (IM_END, AUDIO_PAD)
    done2 = of(run(svc), m.ResponseDone)[0]
    # turn 1's last sampled row had no KV yet: it is prefilled (and counted) with turn 2
    assert done2.cached_rows == len(hist) - 1 and done2.prompt_rows == len(new) + 1
    # Only the new rows (and the first answer's last row, sampled but never run) went through prefill.
    assert eng.stats().prefilled_rows - before == len(new) + 1
    assert eng.conversation_history("s")[:len(hist) + len(new)] == hist + new
    eng.check_integrity()


def test_audio_turn_incremental_prefill_and_audio_out() -> None:
    svc = make_service()
    eng = svc.engine
    # The session's sampling is known when speech starts, so the open request already has it.
    send(svc, m.OpenSession("s", sampling=greedy(12, min_new=12)))
    pcm = speech(1.0)
    codes_seen, progress = 0, []
    for i in range(0, len(pcm), 640 * 2):  # 40 ms pieces
        out = send(svc, m.AppendUserAudio("s", pcm[i:i + 1280]))
        progress += of(out, m.UserAudioProgress)
        run(svc)  # the engine prefills what arrived while the "user" keeps talking
    codes_seen = progress[-1].codes
    assert codes_seen == 12 and [p.codes for p in progress] == list(range(1, 13))
    head = PB.system_rows(None, "audio") + PB.audio_turn_open_rows()
    assert progress[-1].prefilled_rows == len(PB.audio_turn_open_rows()) + 12
    assert eng.stats().prefilled_rows == len(head) + 12  # all of it is already in the KV
    out = send(svc, m.CommitUserAudio("s", "item"))
    assert of(out, m.UserAudioProgress)[0].codes == 13  # the last partial 80 ms
    before = eng.stats().prefilled_rows
    started = send(svc, m.CreateResponse("s", "r1", "audio", greedy(12, min_new=12)))
    out = run(svc)
    # At end of turn only the last code, the closing rows and the assistant prefix remain.
    tail = 1 + len(PB.audio_turn_close_rows()) + len(PB.assistant_prefix_rows("audio"))
    assert eng.stats().prefilled_rows - before == tail
    done = of(out, m.ResponseDone)[0]
    assert started[0].prompt_rows == done.prompt_rows == len(head) + 13 + tail - 1
    enc = FakeEncoderStream()
    all_codes = enc.push(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0) + enc.finalize()
    whole = PB.system_rows(None, "audio") + PB.user_audio_turn_rows(all_codes) + PB.assistant_prefix_rows("audio")
    hist = eng.conversation_history("s")
    assert hist[:len(whole)] == whole
    gen = hist[len(whole):]
    assert all(t == MODALITY_PAD for t, _ in gen)  # spoken answer (eosp masked by min_new_tokens)
    chunks = of(out, m.AudioChunk)
    assert [c.index for c in chunks] == list(range(len(chunks))) and len(chunks) == 3  # 5 + 5 + final 2
    assert done.audio_samples == sum(len(c.pcm24k) // 2 for c in chunks) == 12 * 1920
    assert svc.decoder.streams[0].codes == [a for _, a in gen]
    assert svc.decoder.streams[0].closed
    assert done.engine_ttfa_ms is not None and done.status == "incomplete"


@pytest.mark.parametrize("turn", ["text", "spoken"])
def test_an_answer_ramps_until_it_has_the_codes_its_first_audio_waits_for(turn) -> None:
    """An answer ramps (the engine keeps its steps short, the codec holds rounds of playing answers, user audio waits)
    until it has the codes its decoder stream's first audio needs: 10 with a full-context voice's prompt tail of 3,
    where a windowed chunk needs 8. The engine's request is told as much, whether the answer opens a request (a text
    turn) or closes the user's open one (a spoken turn)."""
    class TenCodes(FakeDecoderStream):
        first_audio_codes = 10

    svc = make_service()
    svc.decoder.open_stream = lambda session_id, voice=None, seed=0: TenCodes()
    send(svc, m.OpenSession("s", sampling=greedy(14, min_new=14)))
    if turn == "text":
        send(svc, m.AddUserText("s", "i1", "Hello"))
    else:
        send(svc, m.AppendUserAudio("s", speech(0.5)))
        run(svc)
        send(svc, m.CommitUserAudio("s", "item"))
    send(svc, m.CreateResponse("s", "r1", "audio", greedy(14, min_new=14)))
    t = svc.sessions["s"].active
    assert svc.engine.live_request(t.request_id).ramp_rows == 10
    seen = []
    while len(t.response.code_idx) < 12:
        service_loop.step(svc)
        seen.append((len(t.response.code_idx), svc._ramping()))
    assert all(ramping == (codes < 10) for codes, ramping in seen if codes), seen
    assert {codes for codes, _ in seen} >= {9, 10}
    run(svc)
    svc.engine.check_integrity()


def test_a_spoken_answer_marks_where_its_commit_went(caplog) -> None:
    """The stage marks logged at first audio place the commit's encoder call between the commit's arrival and its
    last codes, all before the CreateResponse (engines/profiling/stage_marks.py splits commit -> its codes there)."""
    caplog.set_level(logging.INFO, logger="engines.process")
    svc = make_service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AppendUserAudio("s", speech(0.5)))
    send(svc, m.CommitUserAudio("s", "item"))
    send(svc, m.CreateResponse("s", "r1", "audio", greedy(6, min_new=6)))
    run(svc)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("response r1: first audio")]
    marks = ast.literal_eval(line.split("stages ", 1)[1])
    assert marks["commit_in"] <= marks["commit_call"] <= marks["commit_encoded"] <= 0 < marks["first_audio"]


def test_cancel_then_close_frees_every_block() -> None:
    svc = make_service()
    eng = svc.engine
    total = eng.stats().total_blocks
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "talk"))
    send(svc, m.CreateResponse("s", "r1", "audio", m.Sampling(max_new_tokens=400, min_new_tokens=400)))
    for _ in range(4):
        svc.step()
    assert eng.stats().running == 1
    assert send(svc, m.CancelResponse("s", "r1")) == []
    out = run(svc)
    done = of(out, m.ResponseDone)[0]
    assert done.status == "cancelled" and done.reason == "client_cancelled" and done.output_rows == 4
    assert eng.stats().free_blocks < total  # the history stays cached for the next turn
    assert send(svc, m.CancelResponse("s", "r1")) == []  # cancelling a finished response: ignored
    send(svc, m.CloseSession("s"))
    assert eng.stats().free_blocks == total
    eng.check_integrity()
    assert of(send(svc, m.AddUserText("s", "i", "x")), m.Error)[0].code == "invalid_request"


def test_close_during_response_frees_blocks_at_next_step() -> None:
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "talk"))
    send(svc, m.CreateResponse("s", "r1", "text", m.Sampling(max_new_tokens=400)))
    svc.step()
    send(svc, m.CloseSession("s"))
    run(svc)
    assert eng.stats().free_blocks == eng.stats().total_blocks
    eng.check_integrity()


def spoken_answer(svc: Service, n: int, **kw) -> list:
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "talk"))
    send(svc, m.CreateResponse("s", "r1", "audio", greedy(n, min_new=n)))
    return run(svc)


def test_truncate_finished_answer_to_heard_codes() -> None:
    svc = make_service()
    eng = svc.engine
    spoken_answer(svc, 10)
    hist = eng.conversation_history("s")
    gen_start = len(hist) - 10
    # 3 whole codes heard (+ a bit of the 4th): keep the sosp prefix and 3 code rows.
    assert send(svc, m.TruncateResponse("s", "r1", 3 * 1920 + 500)) == []
    assert eng.conversation_rows("s") == gen_start + 3
    send(svc, m.AddUserText("s", "i2", "next"))
    send(svc, m.CreateResponse("s", "r2", "text", greedy(2)))
    run(svc)
    h2 = eng.conversation_history("s")
    assert h2[:gen_start + 3] == hist[:gen_start + 3]
    # The cut span is closed: eosp, <|im_end|>, \n, then the next user turn.
    assert h2[gen_start + 3:gen_start + 6] == [(MODALITY_PAD, EOSP), (IM_END, AUDIO_PAD), (10, AUDIO_PAD)]
    assert h2[gen_start + 6] == (151644, AUDIO_PAD)
    eng.check_integrity()


def test_truncate_with_no_code_heard_keeps_open_span_closed() -> None:
    svc = make_service()
    eng = svc.engine
    spoken_answer(svc, 6)
    gen_start = eng.conversation_rows("s") - 6
    send(svc, m.TruncateResponse("s", "r1", 1000))
    assert eng.conversation_rows("s") == gen_start
    assert eng.conversation_history("s")[-1] == (SOSP, AUDIO_PAD)
    assert svc.sessions["s"].close_rows[:2] == [(MODALITY_PAD, EOSP), (IM_END, AUDIO_PAD)]


def test_truncate_live_response_aborts_and_cuts() -> None:
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "talk"))
    send(svc, m.CreateResponse("s", "r1", "audio", m.Sampling(max_new_tokens=300, min_new_tokens=300)))
    for _ in range(8):
        svc.step()
    send(svc, m.CancelResponse("s", "r1"))
    send(svc, m.TruncateResponse("s", "r1", 2 * 1920))
    done = of(run(svc), m.ResponseDone)[0]
    assert done.status == "cancelled" and done.output_rows == 8  # one row per step (prefill samples too)
    assert eng.conversation_history("s")[-1][0] == MODALITY_PAD
    assert eng.conversation_rows("s") == done.cached_rows + done.prompt_rows + 2


def test_truncate_after_new_speech_reprefills_the_user_turn() -> None:
    svc = make_service()
    eng = svc.engine
    spoken_answer(svc, 10)
    gen_start = eng.conversation_rows("s") - 10
    send(svc, m.AppendUserAudio("s", speech(0.4)))  # barge-in: 5 codes already in the engine
    run(svc)
    assert svc.sessions["s"].active is not None
    send(svc, m.TruncateResponse("s", "r1", 2 * 1920))  # the client reports what it played, later
    run(svc)
    send(svc, m.AppendUserAudio("s", speech(0.2, seed=1)))
    send(svc, m.CommitUserAudio("s", "i"))
    send(svc, m.CreateResponse("s", "r2", "text", greedy(2)))
    run(svc)
    h = eng.conversation_history("s")
    close = [(MODALITY_PAD, EOSP), (IM_END, AUDIO_PAD), (10, AUDIO_PAD)]
    assert h[gen_start + 2:gen_start + 5] == close
    user = h[gen_start + 5:]
    codes = [a for t, a in user if t == MODALITY_PAD and a != EOSP]
    assert len(codes) == 5 + 3 and user[:len(PB.audio_turn_open_rows())] == PB.audio_turn_open_rows()
    eng.check_integrity()


def test_clear_user_audio_undoes_its_prefill() -> None:
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s"))
    send(svc, m.AppendUserAudio("s", speech(0.5)))
    run(svc)
    assert eng.stats().prefilled_rows > 0
    send(svc, m.ClearUserAudio("s"))
    run(svc)
    assert eng.conversation_rows("s") == 0 and eng.stats().free_blocks == eng.stats().total_blocks
    eng.check_integrity()
    assert of(send(svc, m.CommitUserAudio("s", "i")), m.Error)[0].code == "invalid_request"  # nothing to commit
    send(svc, m.AddUserText("s", "i", "typed"))
    send(svc, m.CreateResponse("s", "r", "text", greedy(2)))
    run(svc)
    h = eng.conversation_history("s")
    first = PB.system_rows(None, "text") + PB.text_turn_rows("user", "typed") + PB.assistant_prefix_rows("text")
    assert h[:len(first)] == first  # the system turn is chosen again, for the text answer


def test_new_sampling_reprefills_user_turn_with_same_rows() -> None:
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s", sampling=greedy(5)))
    send(svc, m.AppendUserAudio("s", speech(0.3)))
    send(svc, m.CommitUserAudio("s", "i"))
    run(svc)
    out = send(svc, m.CreateResponse("s", "r", "text", greedy(3)))  # differs from the session's: requeued
    assert out == []
    out += run(svc)
    done = of(out, m.ResponseDone)[0]
    assert of(out, m.ResponseStarted)[0].prompt_rows == done.prompt_rows
    assert done.output_rows == 3 and done.cached_rows == 0
    h = eng.conversation_history("s")
    # Undone and sent again with the response: the system prompt now follows the known modality.
    codes = [a for t, a in h if t == MODALITY_PAD and a != EOSP]
    whole = PB.system_rows(None, "text") + PB.user_audio_turn_rows(codes) + PB.assistant_prefix_rows("text")
    assert len(codes) == 4 and h[:len(whole)] == whole
    assert len(h) == done.prompt_rows + 3 == len(whole) + 3
    eng.check_integrity()


def test_errors_answer_and_session_survives() -> None:
    svc = make_service(max_model_len=512)
    assert of(send(svc, m.AddUserText("nope", "i", "x")), m.Error)[0].code == "invalid_request"
    send(svc, m.OpenSession("s"))
    assert of(send(svc, m.OpenSession("s")), m.Error)[0].code == "invalid_request"
    assert of(send(svc, m.AddUserText("s", "i", "x"), client=b"other"), m.Error)[0].message.endswith("another client")
    bad = send(svc, m.CreateResponse("s", "r0", "text", m.Sampling(top_p=0.0)))
    assert [type(x) for x in bad] == [m.Error, m.ResponseDone] and bad[1].status == "failed"
    big = send(svc, m.CreateResponse("s", "r1", "text", m.Sampling(max_new_tokens=1_000)))
    assert big[0].code == "request_too_large" and big[1].status == "failed" and big[0].response_id == "r1"
    assert of(send(svc, m.AppendUserAudio("s", b"\x00")), m.Error)[0].code == "invalid_request"  # odd PCM bytes
    send(svc, m.AddUserText("s", "i", "hi"))
    send(svc, m.CreateResponse("s", "r2", "text", greedy(4)))
    again = send(svc, m.CreateResponse("s", "r3", "text", greedy(2)))
    assert again[0].code == "invalid_request"
    assert again[1] == m.ResponseDone("s", "r3", "failed", reason="invalid_request")
    assert of(send(svc, m.CancelResponse("s", "unknown")), m.Error)
    done = of(run(svc), m.ResponseDone)
    assert [d.response_id for d in done] == ["r2"] and done[0].output_rows == 4
    svc.engine.check_integrity()


def test_ping_reports_stats() -> None:
    svc = make_service()
    pong = send(svc, m.Ping(7))[0]
    assert pong.nonce == 7 and pong.stats["kv_free"] == pong.stats["kv_total"] > 0
    assert {"running", "waiting", "steps", "sessions"} <= pong.stats.keys()


def test_update_session_adds_system_turn_after_first_turn() -> None:
    svc = make_service()
    send(svc, m.OpenSession("s", instructions="Be brief."))
    send(svc, m.AddUserText("s", "i", "a"))
    send(svc, m.CreateResponse("s", "r", "text", greedy(1)))
    run(svc)
    h1 = svc.engine.conversation_history("s")
    assert h1[:len(PB.system_rows("Be brief.", "text"))] == PB.system_rows("Be brief.", "text")
    assert of(send(svc, m.UpdateSession("s", instructions="Be long.")), m.SessionReady)
    send(svc, m.CreateResponse("s", "r2", "text", greedy(1)))
    run(svc)
    h2 = svc.engine.conversation_history("s")
    new = PB.assistant_close_rows(h1[-1]) + PB.text_turn_rows("system", "Be long.")
    assert h2[len(h1):len(h1) + len(new)] == new


@pytest.mark.parametrize("role", ["assistant", "user"])
def test_text_items_of_any_role_become_turns(role: str) -> None:
    svc = make_service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "hé", role=role))
    send(svc, m.CreateResponse("s", "r", "text", greedy(1)))
    run(svc)
    rows = PB.text_turn_rows(role, "hé")
    h = svc.engine.conversation_history("s")
    start = len(PB.system_rows(None, "text"))
    assert h[start:start + len(rows)] == rows


def test_decoder_fault_fails_only_that_response() -> None:
    svc = make_service()

    class Broken(FakeDecoderStream):
        def add(self, codes: list[int]) -> None:
            raise RuntimeError("boom")

    svc.decoder.open_stream = lambda session_id, voice=None, seed=0: Broken()
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "talk"))
    send(svc, m.CreateResponse("s", "r1", "audio", greedy(60, min_new=60)))
    out = run(svc)
    err = of(out, m.Error)[0]
    assert err.code == "engine_error" and "boom" in err.message and err.response_id == "r1"
    done = of(out, m.ResponseDone)[0]
    assert done.status == "failed" and done.output_rows < 60  # aborted when the worker reported it
    assert not svc._codec_owner and not svc.has_work()  # the codec worker holds nothing of it
    send(svc, m.CreateResponse("s", "r2", "text", greedy(2)))
    assert of(run(svc), m.ResponseDone)[0].status == "incomplete"
    svc.engine.check_integrity()


def test_close_after_cleared_speech_forgets_the_conversation() -> None:
    svc = make_service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AppendUserAudio("s", speech(0.3)))
    send(svc, m.ClearUserAudio("s"))
    run(svc)
    send(svc, m.CloseSession("s"))
    assert "s" not in svc.engine.scheduler.conversations and not svc.sessions
    assert send(svc, m.OpenSession("s")) == [m.SessionReady("s")]  # the id can be used again


def test_new_sampling_for_a_spoken_answer_goes_in_with_the_closing_rows() -> None:
    svc = make_service()
    eng = svc.engine
    send(svc, m.OpenSession("s", sampling=greedy(5)))
    send(svc, m.AppendUserAudio("s", speech(0.3)))
    send(svc, m.CommitUserAudio("s", "i"))
    run(svc)
    prefilled = eng.stats().prefilled_rows
    out = send(svc, m.CreateResponse("s", "r", "audio", greedy(3)))  # other settings, same spoken prompt
    out += run(svc)
    done = of(out, m.ResponseDone)[0]
    assert done.output_rows == 3  # the new max_new_tokens applies
    # No second prefill of the user turn: only the assistant prefix went in with the response.
    assert eng.stats().prefilled_rows - prefilled == len(PB.assistant_prefix_rows("audio"))
    eng.check_integrity()


def test_sync_is_answered_after_every_reply_to_the_messages_before_it() -> None:
    svc = make_service(max_model_len=128)
    send(svc, m.OpenSession("s"))
    items = [(C, m.AddUserText("s", f"i{k}", "a long line of history " * 4)) for k in range(12)]
    out = [x for _, x in svc.handle_many([*items, (C, m.Sync("s", 1)), (C, m.AddUserText("s", "late", "x" * 600))])]
    refused = [k for k, x in enumerate(out) if isinstance(x, m.Error)]
    assert refused and out.index(m.Synced("s", 1)) > max(refused[:-1])  # each item past the context is refused...
    assert out[-1].code == "input_too_large"  # ... the one after the Sync after it


def test_a_session_closed_mid_answer_leaves_nothing_of_its_audio_behind() -> None:
    """Its decoder stream is closed and the codec worker forgets the answer (each such answer's decoder state stayed
    for the engine's life: ~40 kB a dropped turn in a soak)."""
    svc = make_service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "talk"))
    send(svc, m.CreateResponse("s", "r1", "audio", greedy(60, min_new=60)))
    for _ in range(12):  # past the first chunk's codes: the codec worker has the answer
        svc.step()
    assert svc.decoder.streams and svc.decoder.streams[0].codes
    send(svc, m.CloseSession("s"))
    run(svc)
    assert all(st.closed for st in svc.decoder.streams)
    assert not svc.has_work()  # the codec worker holds no answer
    svc.engine.check_integrity()
