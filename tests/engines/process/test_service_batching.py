"""Service batching: answers' speech decoded by the codec worker while the engine steps, and user audio encoded in
80 ms groups."""

from __future__ import annotations

import time

import pytest

from engines.audio.wav import float32_to_pcm16
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from engines.speech_out.decoder import CodecDecoder
from tests.engines.process import service_loop
from tests.engines.process.service_loop import WAIT_S
from tests.engines.process.tiny_engine import WAV
from tests.engines.speech_out.decoder_rounds import small_cache_decoder

ROWS = 23  # first chunk (5 + 3 lookahead), then three more, then the final partial one

# The codec worker's PCM is compared byte for byte with a decode on the test's thread. A decode's float sums depend on
# how many intra-op threads split them (1 vs 2 threads: last-bit differences, now and then a sample across an int16
# step), so both run on one; on an oversubscribed box that is also several times faster.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def decoder() -> CodecDecoder:
    return CodecDecoder.load("tiny-random")


def answer(decoder: CodecDecoder, then_create: bool = False, sent_while_stepping: list | None = None,
           services: list | None = None) -> tuple[list[m.AudioChunk], m.ResponseDone, list, list[int]]:
    """(the answer's audio chunks, its ResponseDone, every message, its codes). `sent_while_stepping`: messages are
    also sent while the engine waits for a step (Service.while_stepping); those go there, and into the returned
    messages in the order sent. `services` gets the Service."""
    engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
    svc = Service(engine, StandInTokenizer(), None, decoder)
    if services is not None:
        services.append(svc)
    msgs, codes = [], None
    if sent_while_stepping is not None:
        def step_wait():  # as the engine process does
            outs = [x for _, x in svc.while_stepping()]
            sent_while_stepping.extend(outs)
            msgs.extend(outs)
            return True
        svc.step_wait = step_wait
    greedy = m.Sampling(greedy=True, max_new_tokens=ROWS, min_new_tokens=ROWS)
    svc.handle(b"c", m.OpenSession("s", sampling=greedy))
    svc.handle(b"c", m.AddUserText("s", "i", "hello"))
    svc.handle(b"c", m.CreateResponse("s", "r", "audio", greedy))
    while svc.has_work():
        msgs += [x for _, x in service_loop.step(svc)]
        a = svc.sessions["s"].answer
        if codes is None and a is not None and a.response_id == "r":
            codes = [a.rows[i][1] for i in a.code_idx]
        if then_create and svc.sessions["s"].completing is not None:
            # asked while the answer's last audio is still decoding: it must wait for that answer's ResponseDone
            msgs += [x for _, x in svc.handle(b"c", m.CreateResponse("s", "r2", "text", greedy))]
            then_create = False
    done = next(x for x in msgs if isinstance(x, m.ResponseDone))
    return [x for x in msgs if isinstance(x, m.AudioChunk)], done, msgs, codes


def test_codec_worker_gives_the_offline_audio_in_order(decoder):
    chunks_t, done_t, msgs, codes = answer(decoder, then_create=True)
    assert [c.index for c in chunks_t] == list(range(len(chunks_t)))
    assert len(chunks_t) >= ROWS // 5  # chunk by chunk as the worker decodes them, not all at the end
    # The last audio is finalized on the worker; ResponseDone follows it, and a response asked for meanwhile
    # starts only after that (its first message comes after the first answer's ResponseDone).
    kinds = [(type(x).__name__, getattr(x, "response_id", None)) for x in msgs]
    done_at = kinds.index(("ResponseDone", "r"))
    assert all(i < done_at for i, k in enumerate(kinds) if k == ("AudioChunk", "r"))
    r2 = [i for i, k in enumerate(kinds) if k[1] == "r2"]
    assert r2 and min(r2) > done_at
    # The same PCM as the whole answer's codes streamed at once (the same chunks, in the same order).
    assert len(codes) == ROWS  # every row a code: eosp is masked
    assert b"".join(c.pcm24k for c in chunks_t) == float32_to_pcm16(decoder.stream_all(codes, seed=0))
    assert done_t.audio_samples == ROWS * 1920 and done_t.output_rows == ROWS


class GatedDecoder:
    """The real decoder, whose first round starts only while the engine waits for a step (`waiting`), noting which
    wait."""

    def __init__(self, decoder: CodecDecoder, waiting, wait_no) -> None:
        self._decoder, self.waiting, self.wait_no, self.ran_in = decoder, waiting, wait_no, []

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def run_jobs(self, jobs, between=None):
        if not self.ran_in:
            assert self.waiting.wait(WAIT_S), "the engine never waited for a step"
            self.ran_in.append(self.wait_no[0])
        return self._decoder.run_jobs(jobs, between=between)


class Sent(list):
    """(the simulated step wait during which it was sent, message)"""

    def __init__(self, wait_no: list[int]) -> None:
        super().__init__()
        self.wait_no = wait_no

    def extend(self, msgs):
        super().extend((self.wait_no[0], x) for x in msgs)


def test_audio_decoded_during_a_step_leaves_during_it_and_is_the_same_audio(decoder, monkeypatch):
    """PCM the codec worker posts while the engine waits for a step's tokens is sent in that wait (on a GPU the wait
    is most of the loop's time; before, the PCM waited for the step's end); an answer's last result and ResponseDone
    still wait for the step's end. Each step's GPU wait is simulated: at least 20 ms, polled as on a GPU, and the
    codec's first round runs inside one (the wait lasts until its PCM is posted; a wait that begins once the first
    chunk's codes are in also lasts until the round starts, so a slow worker thread cannot miss the answer's steps)."""
    import threading

    from engines.lm.runner import PendingTokens

    real_get = PendingTokens.get
    waiting, wait_no, polls, stuck = threading.Event(), [0], [], []
    services, gates = [], []

    def first_due(codec) -> bool:
        """The first chunk's codes are in and its round has not run."""
        with codec._cv:
            return any(a.codes_in >= a.stream.first_audio_codes and a.first_post is None
                       for a in codec._answers.values())

    def get(self, on_wait=None):
        wait_no[0] += 1
        waiting.set()
        now = time.monotonic()
        end, give_up = now + 0.02, now + WAIT_S  # (the GPU's time for a step; then a bound on the hold)
        while on_wait is not None:
            polls.append(on_wait())
            codec = services[0]._codec if services else None
            hold = codec is not None and (codec.first_in_flight or codec._results
                                          or (gates and not gates[0].ran_in and first_due(codec)))
            if hold and time.monotonic() > give_up:
                stuck.append(wait_no[0])
            if not polls[-1] or stuck or (time.monotonic() > end and not hold):
                break
            time.sleep(0.0005)
        if on_wait is None:
            time.sleep(0.02)
        waiting.clear()
        return real_get(self)

    monkeypatch.setattr(PendingTokens, "get", get)
    chunks0, done0, _, _ = answer(decoder)
    assert not polls  # without a step_wait the engine does not poll
    gated = GatedDecoder(decoder, waiting, wait_no)
    gates.append(gated)
    sent = Sent(wait_no)
    chunks, done, msgs, _ = answer(gated, sent_while_stepping=sent, services=services)
    assert polls and not stuck, f"the first chunk's round never posted in wait {stuck}"
    in_wait, first = next((w, x) for w, x in sent if isinstance(x, m.AudioChunk))
    assert first.index == 0 and in_wait == gated.ran_in[0]  # sent in the wait its round ran in
    assert not any(isinstance(x, m.ResponseDone) for _, x in sent)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert b"".join(c.pcm24k for c in chunks) == b"".join(c.pcm24k for c in chunks0)
    assert isinstance(msgs[-1], m.ResponseDone) and done.audio_samples == done0.audio_samples


class CountingEncoder:
    """The real encoder, counting its batched calls: `steps` gets each step's stream count, `finals` each
    batched finalize's."""

    def __init__(self, enc, steps: list[int], finals: list[int] | None = None) -> None:
        self.enc, self.steps, self.finals = enc, steps, finals if finals is not None else []

    def open_stream(self):
        return self.enc.open_stream()

    def batch(self, urgent=True):
        real, counter = self.enc.batch(urgent), self

        class Batch:
            def step(self, items):
                counter.steps.append(len(items))
                return real.step(items)

            def finalize(self, streams, last=None):
                counter.finals.append(len(streams))
                return real.finalize(streams, last)
        return Batch()


def test_commits_of_several_sessions_in_one_encoder_call_give_the_same_answers():
    """Commit + CreateResponse of three sessions arriving in one message batch: one batched finalize for the
    three, the same codes and greedy answers as when each message is handled alone; a commit that fails (no
    speech, unknown session) gets its own error and the others go on."""
    from engines.audio.wav import float32_to_pcm16, read_wav
    from engines.speech_in import SpeechEncoder

    enc = SpeechEncoder.load("tiny-random")
    pcm, _ = read_wav(WAV)
    speech = {sid: float32_to_pcm16(pcm[i * 9000:i * 9000 + 12000]) for i, sid in enumerate("abc")}
    greedy = m.Sampling(greedy=True, max_new_tokens=5)

    def run(together: bool):
        steps: list[int] = []
        finals: list[int] = []
        engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
        # Audio held for the whole test (the interval never passes): the commit encodes all of it.
        svc = Service(engine, StandInTokenizer(), CountingEncoder(enc, steps, finals), None, encode_every_s=3600.0)
        for sid in "abcd":
            svc.handle(b"c", m.OpenSession(sid, sampling=greedy))
        for sid, audio in speech.items():
            svc.handle(b"c", m.AppendUserAudio(sid, audio))
        batch = [(b"c", msg) for sid in "abcdz" for msg in (m.CommitUserAudio(sid, "i"),
                                                            m.CreateResponse(sid, "r", "text", greedy))]
        out = svc.handle_many(batch) if together else [o for item in batch for o in svc.handle(*item)]
        while svc.has_work():
            out += svc.step()
        errors = sorted((x.session_id, x.code) for _, x in out if isinstance(x, m.Error))
        done = {x.session_id: x.status for _, x in out if isinstance(x, m.ResponseDone)}
        return [engine.conversation_history(sid) for sid in "abc"], errors, done, finals

    alone, errors_alone, done_alone, finals_alone = run(False)
    together, errors, done, finals = run(True)
    assert finals_alone == [] and finals == [3]  # (alone: each stream finalizes itself)
    assert together == alone and len({str(h) for h in together}) == 3
    assert errors == errors_alone
    assert {sid for sid, _ in errors} == {"d", "z"}  # d: nothing to commit; z: no such session
    assert done == done_alone and all(done[sid] in ("completed", "incomplete") for sid in "abc")  # (max tokens)


def test_user_audio_encoded_on_a_cadence_gives_the_same_codes_and_answer():
    """Held and encoded every 80 ms for all sessions together (one batched call) == encoded piece by piece."""
    from engines.audio.wav import float32_to_pcm16, read_wav
    from engines.speech_in import SpeechEncoder

    enc = SpeechEncoder.load("tiny-random")
    pcm, _ = read_wav(WAV)
    pcm16 = float32_to_pcm16(pcm[:16000])
    other16 = float32_to_pcm16(pcm[16000:32000])  # a second session says something else
    greedy = m.Sampling(greedy=True, max_new_tokens=6)
    calls: list[list[int]] = []  # pieces per encoder call: one entry per call, each the pieces' sessions

    def run(every_s: float) -> tuple[list, list, list[int]]:
        calls.append([])
        now = [0.0]
        engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
        svc = Service(engine, StandInTokenizer(), CountingEncoder(enc, calls[-1]), None, encode_every_s=every_s)
        svc._speech._clock = lambda: now[0]
        for sid in ("a", "b"):
            svc.handle(b"c", m.OpenSession(sid, sampling=greedy))
        for i in range(0, len(pcm16), 640):  # 20 ms pieces from both sessions, a little apart
            svc.handle(b"c", m.AppendUserAudio("a", pcm16[i:i + 640]))
            now[0] += 0.005
            svc.handle(b"c", m.AppendUserAudio("b", other16[i:i + 640]))
            now[0] += 0.015
            svc.step()  # the engine loop: encodes held audio when due
            while svc.engine.has_work():
                svc.step()
        for sid in ("a", "b"):
            svc.handle(b"c", m.CommitUserAudio(sid, "i"))
            svc.handle(b"c", m.CreateResponse(sid, "r", "text", greedy))
        while svc.has_work():
            svc.step()
        return engine.conversation_history("a"), engine.conversation_history("b"), calls[-1]

    a_every, b_every, every_calls = run(0.0)
    a_held, b_held, held_calls = run(0.08)
    assert (a_held, b_held) == (a_every, b_every)  # same codes in the same rows, same greedy answers
    assert a_held != b_held
    # Each piece alone (two sessions a piece apart are not in one batch) vs both sessions every 80 ms.
    assert every_calls == [1] * 100  # 50 pieces of 20 ms per session, each in a call of its own
    assert held_calls == [2] * 12 and held_calls  # 1 s = 12 x 80 ms with both sessions in each call


@pytest.mark.parametrize("then", ["cancel", "close"])
def test_cancel_or_close_while_the_last_audio_decodes(decoder, then):
    """Right after an answer ends its last audio is still on the codec worker: cancelling it drops that audio
    (ResponseDone says cancelled, no chunk follows), closing the session ends quietly; blocks and the decoder's pages
    all return."""
    engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
    svc = Service(engine, StandInTokenizer(), None, decoder)
    greedy = m.Sampling(greedy=True, max_new_tokens=ROWS, min_new_tokens=ROWS)
    svc.handle(b"c", m.OpenSession("s", sampling=greedy))
    svc.handle(b"c", m.AddUserText("s", "i", "hello"))
    svc.handle(b"c", m.CreateResponse("s", "r", "audio", greedy))
    msgs, acted_at = [], None
    while svc.has_work():
        msgs += [x for _, x in service_loop.step(svc)]
        if acted_at is None and "s" in svc.sessions and svc.sessions["s"].completing is not None:
            acted_at = len(msgs)
            msg = m.CancelResponse("s", "r") if then == "cancel" else m.CloseSession("s")
            msgs += [x for _, x in svc.handle(b"c", msg)]
    assert acted_at is not None, "the answer never waited for its last audio"
    after = msgs[acted_at:]
    assert not any(isinstance(x, m.AudioChunk) for x in after)
    done = [x for x in msgs if isinstance(x, m.ResponseDone)]
    if then == "cancel":
        assert [d.status for d in done] == ["cancelled"]
    else:
        assert done == []  # the session is gone: nobody to tell
    assert not svc.has_work()
    if then == "cancel":
        svc.handle(b"c", m.CloseSession("s"))
        service_loop.until_idle(svc)
    assert engine.stats().free_blocks == engine.stats().total_blocks
    engine.check_integrity()
    decoder.check_idle_cache()  # the decoder's pages too
    svc._codec.close()


def test_user_audio_waits_while_an_answer_waits_for_its_first_codes():
    from engines.process.encoder_worker import ENCODE_DEFER_S
    from engines.speech_in import SpeechEncoder

    enc = SpeechEncoder.load("tiny-random")
    engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
    svc = Service(engine, StandInTokenizer(), enc, None, encode_every_s=0.08)
    now = [0.0]
    svc._speech._clock = lambda: now[0]
    audio = m.Sampling(greedy=True, max_new_tokens=20, min_new_tokens=20)
    for sid in ("a", "b"):
        svc.handle(b"c", m.OpenSession(sid, sampling=audio))
    svc.handle(b"c", m.AppendUserAudio("b", bytes(6400)))  # 0.2 s of silence from b
    now[0] += 0.1
    svc.step()
    assert not svc._speech.holding("b")  # nobody waits for codes: encoded on the 80 ms cadence

    svc.handle(b"c", m.AddUserText("a", "i", "hello"))
    svc.handle(b"c", m.CreateResponse("a", "r", "audio", audio))  # a's answer now waits for its first codes
    svc.handle(b"c", m.AppendUserAudio("b", bytes(6400)))
    now[0] += 0.1
    svc.step()
    assert svc._speech.holding("b")  # held back for a's first codes
    now[0] += ENCODE_DEFER_S
    svc.step()
    assert not svc._speech.holding("b")  # but not for longer than ENCODE_DEFER_S


def test_encoder_interval_grows_with_the_sessions_holding_audio():
    """With many sessions holding audio the batched encoder call comes less often (its cost grows with the
    sessions in it), up to ENCODE_MAX_EVERY_S; with a few it comes every encode_every_s."""
    from engines.process.encoder_worker import ENCODE_MAX_EVERY_S, ENCODE_SESSIONS_PER_INTERVAL
    from engines.speech_in import SpeechEncoder

    enc = SpeechEncoder.load("tiny-random")
    piece = bytes(2 * 1280)  # 80 ms of silence (one code)

    def calls_by(sessions: int, times: list[float]) -> list[int]:
        steps: list[int] = []
        now = [0.0]
        engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
        svc = Service(engine, StandInTokenizer(), CountingEncoder(enc, steps), None, encode_every_s=0.08)
        svc._speech._clock = lambda: now[0]
        for i in range(sessions):
            svc.handle(b"c", m.OpenSession(f"s{i}"))
            svc.handle(b"c", m.AppendUserAudio(f"s{i}", piece))
        seen = []
        for t in times:
            now[0] = t
            svc.step()
            seen.append(len(steps))
        return seen

    few = calls_by(2, [0.05, 0.08])
    assert few == [0, 1]
    many = 2 * ENCODE_SESSIONS_PER_INTERVAL + 1  # three times the interval
    assert calls_by(many, [0.08, 0.2, 0.24]) == [0, 0, 1]
    assert calls_by(10 * ENCODE_SESSIONS_PER_INTERVAL, [0.3, ENCODE_MAX_EVERY_S]) == [0, 1]  # capped


def test_an_answer_that_outgrows_the_decoder_cache_fails_busy_and_the_session_goes_on():
    """The full-context decoder's cache holds the default voice's 4 pages and 3 more: a 23-code answer needs 5 (its
    first job 2, then one a chunk), fewer than the chunks an answer always keeps, so its third chunk finds none:
    server_busy, ResponseDone failed, the pages it had back. A shorter answer in the same session then speaks."""
    small = small_cache_decoder(7)
    engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
    svc = Service(engine, StandInTokenizer(), None, small)
    svc.handle(b"c", m.OpenSession("s"))
    svc.handle(b"c", m.AddUserText("s", "i", "hello"))
    svc.handle(b"c", m.CreateResponse("s", "r", "audio", m.Sampling(greedy=True, max_new_tokens=ROWS,
                                                                     min_new_tokens=ROWS)))
    msgs = [x for _, x in service_loop.until_idle(svc)]
    assert [(e.code, e.response_id) for e in msgs if isinstance(e, m.Error)] == [("server_busy", "r")]
    assert [d.status for d in msgs if isinstance(d, m.ResponseDone)] == ["failed"]
    small.check_idle_cache()
    # (/health and /metrics): the default voice's 4 pages held, the rest free
    assert (svc.stats()["decoder_pages_free"], svc.stats()["decoder_pages_total"]) == (3, 7)
    assert (svc.stats()["decoder_pages_kept"], svc.stats()["decoder_pages_forgotten"]) == (28, 0)
    svc.handle(b"c", m.CreateResponse("s", "r2", "audio", m.Sampling(greedy=True, max_new_tokens=8, min_new_tokens=8)))
    msgs = [x for _, x in service_loop.until_idle(svc)]
    assert not [e for e in msgs if isinstance(e, m.Error)]
    assert [(d.status, d.audio_samples) for d in msgs if isinstance(d, m.ResponseDone)] == [("incomplete", 8 * 1920)]
    small.check_idle_cache()
    svc._codec.close()


def test_a_long_answer_in_a_short_decoder_cache_forgets_its_oldest_chunks_and_plays_to_its_end():
    """A cache of the default voice's 4 pages and 8 more, an answer keeping 6 (decoded and reserved ahead): a 60-code
    answer (13 pages in all) plays every code, forgetting its oldest chunks as it goes; /health counts them; every
    page comes back."""
    small = small_cache_decoder(12)
    small.full.kept_pages, small.full.low_water = 6, 3
    engine = Engine.from_name("tiny-random", EngineConfig(kv_cache_bytes=8 << 20, max_model_len=1024), seed=0)
    svc = Service(engine, StandInTokenizer(), None, small)
    svc.handle(b"c", m.OpenSession("s"))
    svc.handle(b"c", m.AddUserText("s", "i", "hello"))
    svc.handle(b"c", m.CreateResponse("s", "r", "audio", m.Sampling(greedy=True, max_new_tokens=60,
                                                                     min_new_tokens=60)))
    msgs = [x for _, x in service_loop.until_idle(svc)]
    assert not [e for e in msgs if isinstance(e, m.Error)]
    assert [(d.status, d.audio_samples) for d in msgs if isinstance(d, m.ResponseDone)] == [("incomplete", 60 * 1920)]
    assert svc.stats()["decoder_pages_forgotten"] > 0 and svc.stats()["decoder_pages_free"] == 8
    small.check_idle_cache()
    svc._codec.close()
