"""The engine service without its socket: session messages in, engine calls, session messages out.

`Service.handle(client, msg)` and `Service.step()` return `(client, message)` pairs to send; the
client is the ZeroMQ identity that opened the session (process.py routes them). Everything here
runs on one thread, between engine steps (`handle_early` and `while_stepping` also while a step's tokens are on
the GPU, touching no engine request).

Rules the server can rely on:
- Every message about an unknown session, or a session opened by another client, gets
  `Error(code="invalid_request")`. Engine errors keep their `code` (engines/api.py). No error ends
  a session.
- Every CreateResponse ends in exactly one `ResponseDone` (status completed / incomplete
  (max_output_tokens) / cancelled / failed); a refused one gets an `Error` with its response_id
  first, then `ResponseDone(status="failed")`.
- CancelResponse of a live response aborts it (the KV keeps the rows generated so far, closed as
  in PromptBuilder.assistant_close_rows); a cancel of a response that already finished is ignored.
- TruncateResponse keeps only the speech the user heard: `audio_samples_played // 1920` whole
  codes (sessions.Answer.cut); rows after the last heard code are dropped from the KV and the
  span and turn are closed (eosp, `<|im_end|>\\n`) before the next turn. It applies to the live
  response (which it aborts) or to the latest finished one; once a later response has started it
  is refused. A user turn already prefilled after that answer is re-prefilled after the cut.
- Audio responses stream `AudioChunk` (PCM16 24 kHz) as soon as the decoder yields PCM; text-mode
  rows of any response stream as `TextDelta` (control tokens skipped); text responses get no audio.
- User audio is encoded as it arrives and prefilled in the engine while the user talks;
  `UserAudioProgress` follows each batch of codes. A session's messages after a commit wait until the encoder
  has finalized the turn (encoder_worker.py; on a GPU that runs on a thread of its own while the engine steps).
  Text items (AddUserText) wait and go in with the next response, after any user speech already in the engine.
- The system turn goes in with the first rows sent: `instructions`, else the default prompt for
  the first response's modality (the spoken one when user speech comes first). New instructions
  after that are added as another system turn.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engines.api import ChannelSampling, EngineError, InvalidRequestError, SamplingParams, StepOutput
from engines.audio.wav import float32_to_pcm16, pcm16_to_float32
from engines.config import ConfigError
from engines.kernels.tuning import device_name
from engines.process.codec_worker import FIRST_CHUNK_CODES, CodecWorker
from engines.process.encoder_worker import EncoderWorker
from engines.process.observe.spans import Spans
from engines.process.prompt import PromptBuilder
from engines.process.sessions import Answer, ResponseState, Session, Turn
from engines.process.tokenizer import IncrementalDetokenizer, TextTokenizer
from engines.protocol import errors
from engines.protocol import messages as m
from engines.tokens import Row

log = logging.getLogger("engines.process")

Out = tuple[bytes, Any]


class ServiceError(Exception):
    def __init__(self, code: str, message: str, response_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.response_id = response_id


SLOW_STEP_S = 0.1
_WARM_UP = b"warm-up"  # the client id of the start-up turns


def _speech_error(e: Exception) -> ServiceError:
    """What a client is told of a speech encoder failure: the engine's own code where it has one (server_busy when
    every KV slot is taken and the pool cannot grow), else engine_error."""
    return ServiceError(e.code if isinstance(e, EngineError) else errors.ENGINE_ERROR,
                        f"speech encoder failed: {type(e).__name__}: {e}")


def sampling_params(s: m.Sampling) -> SamplingParams:
    """One setting for both channels; invalid values raise ConfigError."""
    ch = ChannelSampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                         repetition_penalty=s.repetition_penalty)
    return SamplingParams(text=ch, audio=ch, greedy=s.greedy, min_new_tokens=s.min_new_tokens,
                          max_new_tokens=s.max_new_tokens, seed=s.seed)


class Service:
    def __init__(self, engine: Any, tokenizer: TextTokenizer, encoder: Any = None, decoder: Any = None,
                 voice_loader: Callable[[bytes], Any] | None = None, encode_every_s: float = 0.0,
                 first_decoders: Sequence[Any] = (),
                 encoder_thread: bool = False, codec_round_max: int | None = None,
                 codec_round_period_s: float = 0.0) -> None:
        """`encoder`: has `open_stream()` -> stream with `push(pcm16k float32) -> codes`, `finalize(last)`.
        `decoder` (engines.speech_out.CodecDecoder): has `open_stream(session_id, voice=, seed=)` -> stream
        with `add(codes)`, `take_jobs(finishing=)` and `close()`, and `run_jobs(jobs)` -> PCM (24 kHz float32) of
        chunks of many streams in one batch. Speech is decoded on the codec worker's thread (its own CUDA streams on
        a GPU) while the engine steps (engines/process/codec_worker.py). `voice_loader`: WAV bytes -> the decoder's
        speaker prompt (raises ValueError for a bad recording); without it a session's voice_wav is refused.
        `encode_every_s`: user audio of every session is held and encoded together, in one batched encoder
        call, at most this often (0: at the end of each batch of messages); commits of several sessions are
        finalized in one call. Codes are the same either way (the encoder streams exactly). `encoder_thread`: those
        calls run on a thread of their own, beside the engine steps (engines/process/encoder_worker.py).
        `first_decoders`: lanes of `decoder` (CodecDecoder.lane) on which the codec worker decodes first chunks
        beside its other rounds.
        `codec_round_max`: most playing answers in one of the worker's rounds (None: its BULK_MAX).
        `codec_round_period_s` (with first lanes): the worker's rounds of playing answers start at most this often,
        each with every answer due before the next (0: back to back)."""
        self.engine = engine
        self.voice_loader = voice_loader
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.encoder = encoder
        self.decoder = decoder
        self.sessions: dict[str, Session] = {}
        self._requests: dict[str, tuple[Session, Turn]] = {}
        self.encode_every_s = encode_every_s
        self._speech = None if encoder is None else EncoderWorker(encoder, encode_every_s, threaded=encoder_thread)
        self._codec = None
        if decoder is not None:
            extra = {} if codec_round_max is None else {"bulk_max": codec_round_max}
            self._codec = CodecWorker(decoder, torch.device(getattr(decoder, "device", "cpu")),
                                      first_decoders=first_decoders, period_s=codec_round_period_s, **extra)
        self._codec_owner: dict[int, Session] = {}  # id(response) -> its session, while the worker has its audio
        config = getattr(engine, "config", None)
        # the GPU model for /health (load tests print it), or "cpu"
        self.device_name = device_name(torch.device(getattr(config, "device", "cpu")))
        # What the server sizes its session limit by when none is set (server/limits.py): where the engine runs,
        # the sequences it runs at once, the rows a conversation may reach and those of a KV block.
        self._capacity = {} if config is None else {
            "device": config.device, "max_running": config.max_running, "max_model_len": config.max_model_len,
            "kv_block_rows": config.block_size}
        self._finished_ids: deque[str] = deque(maxlen=64)
        self._out: list[Out] = []
        # Set by the engine process: called again and again while the engine waits for a step's tokens, until it
        # returns False (Engine.step's `on_wait`; it calls handle_early and while_stepping).
        self.step_wait: Callable[[], bool] | None = None
        self.spans = Spans()  # where the loop's time goes, per message kind and step part (the load log)

    # ---- entry points -------------------------------------------------------------------

    def handle(self, client: bytes, msg: Any) -> list[Out]:
        return self.handle_many([(client, msg)])

    def handle_many(self, items: list[tuple[bytes, Any]]) -> list[Out]:
        """Each session's messages in order. User audio goes to the encoder worker, which encodes all sessions'
        together; the commits among these messages are finalized in one encoder call (each alone took ~10 ms on an
        H200), and a session's messages after its commit wait until its turn's last codes are in."""
        for client, msg in items:
            s = self.sessions.get(getattr(msg, "session_id", None))
            if s is not None and s.owner == client and s.commit_pending is not None:
                s.after_commit.append((client, msg))
            else:
                self._dispatch(client, msg)
        self._run_encoder(flush=self.encode_every_s <= 0)
        return self._take()

    def handle_early(self, items: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
        """Messages that arrived while the engine waits for a step's tokens (from inside Engine.step's `on_wait`):
        user audio and commits go to the encoder's thread now (a commit waited half a step on average for the loop);
        everything else, and every later message of the same session, is returned in order, to be handled after the
        step. Nothing here touches the engine's requests."""
        later: list[tuple[bytes, Any]] = []
        blocked: set[Any] = set()  # sessions with a message put off: their next ones must follow it
        for client, msg in items:
            sid = getattr(msg, "session_id", None)
            s = self.sessions.get(sid)
            if (self._speech is None or not self._speech.threaded or sid in blocked or s is None or s.owner != client
                    or not self._early(client, msg, s)):
                later.append((client, msg))
                blocked.add(sid)
        return later

    def _early(self, client: bytes, msg: Any, s: Session) -> bool:
        """Handle user audio or a commit now if that needs only the encoder's worker; False: it must wait."""
        if s.commit_pending is not None:  # waits for the commit in flight, as in handle_many
            if isinstance(msg, m.AppendUserAudio | m.CommitUserAudio):
                s.after_commit.append((client, msg))
                return True
            return False
        if isinstance(msg, m.AppendUserAudio):
            self._dispatch(client, msg)
            return True
        # (A commit with no audio left to finalize ends the turn in the engine: after the step.)
        return isinstance(msg, m.CommitUserAudio) and self._start_commit(client, msg, s)

    def _dispatch(self, client: bytes, msg: Any) -> None:
        handler = getattr(self, "_on_" + type(msg).__name__, None)
        if handler is None:
            self._send(client, m.Error(getattr(msg, "session_id", None), errors.INVALID_REQUEST,
                                       f"{type(msg).__name__} is not a request to the engine"))
            return
        with self.spans.span(type(msg).__name__):
            self._guard(client, msg, handler, client, msg)

    def warm_up(self, batches: tuple[int, ...] = (1, 4), rows: int = 24, timeout_s: float = 300.0) -> None:
        """Throw-away spoken turns (noise in, `rows` answer rows out) for 1, then several sessions at once, so
        that first-use costs are paid before anyone connects: library start-up (cuFFT, cuDNN), per-shape plans
        and Triton compiles that a first caller would otherwise wait 150-500 ms for, stalling every session.
        In a batch of several, the last session answers in text: the text channel's sampling kernels are compiled
        apart from the audio channel's, and a spoken answer samples text once it ends its speech (an H200 load
        test stalled 6.2 s at 108 sessions compiling them). Leaves no session, KV block or codec work behind; raises
        if any turn fails."""
        pcm = float32_to_pcm16((0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32))
        sampling = m.Sampling(max_new_tokens=rows, min_new_tokens=rows)
        for n in batches:
            ids = [f"warm-up-{n}-{i}" for i in range(n)]
            out = [o for sid in ids for o in self.handle(_WARM_UP, m.OpenSession(sid, sampling=sampling))]
            for i in range(0, len(pcm), 640):  # 20 ms pieces of every session together, as under load
                out += self.handle_many([(_WARM_UP, m.AppendUserAudio(sid, pcm[i:i + 640])) for sid in ids])
            for sid in ids:
                out += self.handle(_WARM_UP, m.CommitUserAudio(sid, "warm-up"))
                modality = "text" if n > 1 and sid == ids[-1] else "audio"
                out += self.handle(_WARM_UP, m.CreateResponse(sid, f"{sid}-answer", modality, sampling))
            done: set[str] = set()
            deadline = time.monotonic() + timeout_s
            while len(done) < n and self.has_work() and time.monotonic() < deadline:
                step = self._warm_up_step()
                out += step
                done |= {msg.session_id for _, msg in step if isinstance(msg, m.ResponseDone)}
            for sid in ids:
                out += self.handle(_WARM_UP, m.CloseSession(sid))
            while self.has_work() and time.monotonic() < deadline:  # closed sessions' last audio, KV release
                out += self._warm_up_step()
            failed = [msg for _, msg in out if isinstance(msg, m.Error)]
            if failed or len(done) < n:
                raise RuntimeError(f"warm-up with {n} sessions failed: {failed[:3] or 'answers did not finish'}")

    def _warm_up_step(self) -> list[Out]:
        if not self.engine.has_work():
            time.sleep(0.002)  # only the codec worker is busy: let it have the GIL
        return self.step()

    def _guard(self, client: bytes, msg: Any, fn: Any, *args: Any) -> None:
        """Run fn; an error becomes an Error message to the client (the session survives)."""
        try:
            fn(*args)
        except (ServiceError, EngineError, ConfigError, ValueError) as e:
            self._report(client, msg, e)

    def _report(self, client: bytes, msg: Any, e: ServiceError | EngineError | ConfigError | ValueError) -> None:
        sid, rid = getattr(msg, "session_id", None), getattr(msg, "response_id", None)
        if isinstance(e, ServiceError):
            self._send(client, m.Error(sid, e.code, str(e), e.response_id))
        elif isinstance(e, EngineError):
            self._send(client, m.Error(sid, e.code, str(e), rid))
        else:
            self._send(client, m.Error(sid, errors.INVALID_REQUEST, str(e), rid))

    def has_work(self) -> bool:
        return (self.engine.has_work() or (self._speech is not None and self._speech.busy())
                or (self._codec is not None and self._codec.busy()))

    def step(self) -> list[Out]:
        """One engine step; its rows become deltas, audio chunks and completions."""
        t0 = time.perf_counter()
        self._collect_decoded()
        ramping = self._ramping()
        if self._speech is not None:
            self._speech.lm_ramping = ramping  # an answer waiting for its first codes goes first: user audio waits
            self._run_encoder(flush=False)
        if self._codec is not None:
            self._codec.lm_ramping = ramping
            if self._codec.first_in_flight and not ramping:
                # A first-chunk round is on the GPU and no answer waits for codes: the playing answers are ahead of
                # real time, so this step can wait. Sleep: spinning would take the GIL from the codec thread.
                time.sleep(0.001)
                return self._take()
        t1 = time.perf_counter()
        outputs: list[StepOutput] = self.engine.step(on_wait=self.step_wait)
        t2 = time.perf_counter()
        finished: list[tuple[Session, Turn, StepOutput]] = []
        live: list[tuple[Session, ResponseState]] = []
        for o in outputs:
            entry = self._requests.get(o.request_id)
            if entry is None:
                continue
            s, t = entry
            r = t.response
            if r is not None and o.finish_reason != "abort":  # an abort output carries no row
                r.add_row(o.text_token, o.audio_token, o.mode)
                r.mark("first_row")
                if len(r.code_idx) >= FIRST_CHUNK_CODES:
                    r.mark("first_chunk_codes")
                if o.mode == "text" and not r.cancelled:
                    self._text(s, r, r.detok.push(o.text_token))
                live.append((s, r))
            if o.finished:
                finished.append((s, t, o))
        self._push_codes(live)
        t3 = time.perf_counter()
        for s, t, o in finished:
            try:
                self._finish(s, t, o)
            except (EngineError, ServiceError) as e:
                self._send(s.owner, m.Error(s.session_id, e.code, str(e)))
        t4 = time.perf_counter()
        self.spans.add("engine step", t2 - t1)
        if t4 - t0 > SLOW_STEP_S:  # every session waits for this loop: say where a slow step went
            log.warning("slow step %.0f ms: collect audio %.0f, engine %.0f (%d rows), rows %.0f, finish %.0f (%d)",
                        1e3 * (t4 - t0), 1e3 * (t1 - t0), 1e3 * (t2 - t1), len(outputs), 1e3 * (t3 - t2),
                        1e3 * (t4 - t3), len(finished))
        return self._take()

    def _ramping(self) -> bool:
        """An answer still waits for its first chunk's codes. The GPU is shared by urgency: the codec's rounds are
        ~800 tiny kernels per Euler step and, run beside decode steps, each waits behind a step's kernels (a round
        takes 2-3x as long). While an answer ramps, the codec worker holds back rounds of playing answers and user
        audio is not encoded (<= ENCODE_DEFER_S); while a first-chunk round runs and none ramps, the engine skips
        its step."""
        return self.engine.num_waiting > 0 or any(
            t.response is not None and not t.response.cancelled and t.response.modality == "audio"
            and len(t.response.code_idx) < FIRST_CHUNK_CODES for _, t in self._requests.values())

    def stats(self) -> dict[str, Any]:
        st = self.engine.stats()
        return {"running": st.running, "waiting": st.waiting, "kv_free": st.free_blocks, "kv_total": st.total_blocks,
                "steps": st.steps, "prefilled_rows": st.prefilled_rows, "decoded_rows": st.decoded_rows,
                "sessions": len(self.sessions), "device_name": self.device_name, **self._capacity}

    # ---- helpers ------------------------------------------------------------------------

    def _send(self, client: bytes, msg: Any) -> None:
        self._out.append((client, msg))

    def _take(self) -> list[Out]:
        out, self._out = self._out, []
        return out

    def _session(self, client: bytes, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise ServiceError(errors.INVALID_REQUEST, f"unknown session {sid!r}")
        if s.owner != client:
            raise ServiceError(errors.INVALID_REQUEST, f"session {sid!r} belongs to another client")
        return s

    def _system_rows(self, s: Session, modality: m.Modality) -> list[Row]:
        if s.system_sent:
            return []
        return self.prompts.system_rows(s.instructions, modality)

    def _text(self, s: Session, r: ResponseState, delta: str) -> None:
        if delta:
            r.text.append(delta)
            self._send(s.owner, m.TextDelta(s.session_id, r.response_id, delta))

    def _audio(self, s: Session, r: ResponseState, pcm: np.ndarray | None) -> None:
        if pcm is None or len(pcm) == 0:
            return
        if r.ttfa_ms is None:
            r.ttfa_ms = r.elapsed_ms()
            r.mark("first_audio")
        self._send(s.owner, m.AudioChunk(s.session_id, r.response_id, float32_to_pcm16(pcm), r.chunks))
        r.chunks += 1
        r.audio_samples += len(pcm)

    def _push_codes(self, live: list[tuple[Session, ResponseState]]) -> None:
        """Hand live answers' new codes to the codec worker at once (it batches them by rounds)."""
        for s, r in live:
            if r.decoder_stream is not None and r.new_codes and not r.cancelled:
                self._codec_owner[id(r)] = s
                self._codec.push(r, r.decoder_stream, r.new_codes)
                r.new_codes = []
                if len(r.code_idx) >= FIRST_CHUNK_CODES:
                    r.mark("first_chunk_sent")

    def _deliver(self, s: Session, r: ResponseState, pcm: np.ndarray | Exception, final: bool) -> None:
        """Decoded audio of one answer (or the decoder's failure); `final`: its last, then ResponseDone."""
        if isinstance(pcm, Exception):  # the speech decoder failing ends this answer, not the engine
            log.error("speech decoder failed for %s: %r", r.response_id, pcm)
            if not r.cancelled:
                self._fail(s, r, f"speech decoder failed: {type(pcm).__name__}: {pcm}")
        elif not r.cancelled:
            self._audio(s, r, pcm)
        if final:
            self._complete(s, r)

    def while_stepping(self) -> list[Out]:
        """What can be sent while the engine waits for a step's tokens (from inside Engine.step's `on_wait`): PCM the
        codec worker has posted, instead of after the step (under load a step takes ~10 ms, and an answer's first
        chunk waited half of that on average), and whatever this step produced so far. Only plain audio: an answer's
        last result or a failure changes sessions and the engine, and waits for the step's end."""
        self._collect_decoded(audio_only=True)
        return self._take()

    def _collect_decoded(self, audio_only: bool = False) -> None:
        if self._codec is None:
            return
        for r, result, worker_done in self._codec.take_results(audio_only):
            rounds = self._codec.first_chunk_round(r)
            s = self._codec_owner.get(id(r))
            if s is None:
                continue
            if worker_done:
                del self._codec_owner[id(r)]
            if rounds is not None:
                r.mark("codec_first_round_start", rounds[0])
                r.mark("codec_first_round_end", rounds[1])
            # A failure ends the worker's part; the answer itself is complete only once it has finished.
            final = s.completing is r if isinstance(result, Exception) else worker_done
            self._deliver(s, r, result, final)

    def _fail(self, s: Session, r: ResponseState, why: str) -> None:
        """Stop a response for a server-side fault: abort it; its ResponseDone says failed."""
        self._send(s.owner, m.Error(s.session_id, errors.ENGINE_ERROR, why, r.response_id))
        r.failed, r.cancelled, r.decoder_stream, r.new_codes = why, True, None, []
        t = s.active
        if t is not None and t.response is r:
            self.engine.abort(t.request_id)

    # ---- session lifecycle --------------------------------------------------------------

    def _on_OpenSession(self, client: bytes, msg: m.OpenSession) -> None:
        if msg.session_id in self.sessions:
            raise ServiceError(errors.INVALID_REQUEST, f"session {msg.session_id!r} is already open")
        if self.engine.conversation_rows(msg.session_id):
            raise ServiceError(errors.INVALID_REQUEST, f"session {msg.session_id!r} is still closing")
        s = Session(msg.session_id, client, instructions=msg.instructions, voice_wav=msg.voice_wav,
                    sampling=sampling_params(msg.sampling) if msg.sampling else None,
                    voice=self._voice(msg.voice_wav))
        self.sessions[msg.session_id] = s
        self._send(client, m.SessionReady(msg.session_id))

    def _on_UpdateSession(self, client: bytes, msg: m.UpdateSession) -> None:
        s = self._session(client, msg.session_id)
        voice = self._voice(msg.voice_wav)  # first: a bad update changes nothing
        if msg.sampling is not None:
            s.sampling = sampling_params(msg.sampling)
        if msg.instructions is not None and msg.instructions != s.instructions:
            s.instructions = msg.instructions
            if s.system_sent:
                s.pending_rows += self.prompts.text_turn_rows("system", msg.instructions)
        if msg.voice_wav is not None:
            s.voice_wav, s.voice = msg.voice_wav, voice  # from the next response on
        self._send(client, m.SessionReady(msg.session_id))

    def _voice(self, wav: bytes | None) -> Any:
        if wav is None:
            return None
        if self.voice_loader is None:
            raise ServiceError(errors.INVALID_REQUEST, "this engine cannot use voice prompts (no codec loaded)")
        return self.voice_loader(wav)

    def _on_CloseSession(self, client: bytes, msg: m.CloseSession) -> None:
        s = self._session(client, msg.session_id)
        del self.sessions[msg.session_id]
        if self._speech is not None:
            self._speech.drop(s.session_id)
        if s.completing is not None:
            self._drop_last_audio(s.completing)
        t = s.active
        if t is not None:
            t.undo = "close"
            if t.response is not None:
                t.response.cancelled = True  # nothing more goes to a closed session
            self.engine.abort(t.request_id)  # blocks go back when the abort is reported
        else:
            self._release(s)

    def _release(self, s: Session) -> None:
        try:
            self.engine.release_conversation(s.conversation_id)
        except InvalidRequestError:
            pass  # never reached the engine

    def _on_Ping(self, client: bytes, msg: m.Ping) -> None:
        self._send(client, m.Pong(msg.nonce, self.stats()))

    # ---- user input ---------------------------------------------------------------------

    def _on_AppendUserAudio(self, client: bytes, msg: m.AppendUserAudio) -> None:
        s = self._session(client, msg.session_id)
        if self._speech is None:
            raise ServiceError(errors.INVALID_REQUEST, "this engine has no speech encoder loaded")
        pcm = pcm16_to_float32(msg.pcm16k)  # odd length: ValueError
        self._speech.append(s.session_id, pcm)

    def _run_encoder(self, flush: bool) -> None:
        """Codes the encoder worker has produced go to their sessions; without its thread, the calls that are due
        run here first (`flush`: held audio too, whatever the interval), until none is (a commit's delivery may
        hand over the messages that waited for it, and with them more audio or another commit)."""
        if self._speech is None:
            return
        while True:
            ran = not self._speech.threaded and self._speech.run_due(flush)
            results = self._speech.take_results()
            for e in results:
                s = self.sessions.get(e.key)
                if s is None:
                    continue
                if e.commit:
                    self._commit_done(s, e.codes, e.at, e.started)
                elif isinstance(e.codes, Exception):
                    self._speech_failed(s, e.codes)
                else:
                    self._guard(s.owner, m.AppendUserAudio(s.session_id, b""), self._user_codes, s, e.codes, False)
            if not ran and not results:
                return

    def _on_CommitUserAudio(self, client: bytes, msg: m.CommitUserAudio) -> None:
        s = self._session(client, msg.session_id)
        if not self._start_commit(client, msg, s):  # no audio is left to finalize
            self._committed(s, [])

    def _start_commit(self, client: bytes, msg: m.CommitUserAudio, s: Session) -> bool:
        """The encoder finalizes the turn (False: it holds none of it); the session's next messages wait for that."""
        if self._speech is None or not self._speech.commit(s.session_id):
            return False
        s.commit_pending, s.commit_at = (client, msg), time.monotonic()
        return True

    def _commit_done(self, s: Session, codes: list[int] | Exception, at: float, started: float) -> None:
        """The committed turn's last codes (or the encoder's failure), produced `at` by a call that began `started`;
        then the messages that waited for them."""
        (client, msg), waiting = s.commit_pending, s.after_commit
        s.commit_pending, s.after_commit = None, []
        s.commit_call_at, s.commit_done_at = started, at
        if isinstance(codes, Exception):  # the turn so far is dropped, as when a call of held audio fails
            log.error("speech encoder failed for session %s's commit: %r", s.session_id, codes)
            self._report(client, msg, codes if isinstance(codes, ValueError) else _speech_error(codes))
            self._clear_speech(s)
        else:
            self._guard(client, msg, self._committed, s, codes)
        for i, (c, queued) in enumerate(waiting):
            if s.commit_pending is not None:  # committed again: the rest waits for that one
                s.after_commit += waiting[i:]
                return
            self._dispatch(c, queued)

    def _committed(self, s: Session, codes: list[int]) -> None:
        """The user's turn ends with these last codes (its encoder stream is finalized)."""
        if s.turn_codes + len(codes) == 0:
            raise ServiceError(errors.INVALID_REQUEST, "the input audio buffer holds no speech to commit")
        self._user_codes(s, codes, commit=True)
        s.turn_codes = 0

    def _speech_failed(self, s: Session, e: Exception) -> None:
        """The encoder failed on this session's audio: the turn so far is dropped, as if the client cleared it."""
        log.error("speech encoder failed for session %s: %r", s.session_id, e)
        err = _speech_error(e)
        self._send(s.owner, m.Error(s.session_id, err.code, str(err)))
        self._clear_speech(s)

    def _on_ClearUserAudio(self, client: bytes, msg: m.ClearUserAudio) -> None:
        self._clear_speech(self._session(client, msg.session_id))

    def _clear_speech(self, s: Session) -> None:
        if self._speech is not None:
            self._speech.drop(s.session_id)
        s.pending_codes = []
        s.turn_codes = 0
        t = s.active
        if t is not None and t.audio_open and t.undo in (None, "requeue"):
            t.undo = "clear"
            self.engine.abort(t.request_id)

    def _on_AddUserText(self, client: bytes, msg: m.AddUserText) -> None:
        s = self._session(client, msg.session_id)
        if msg.role == "system" and not s.system_sent and s.instructions is None:
            s.instructions = msg.text  # the first system item is the system prompt
            return
        s.pending_rows += self.prompts.text_turn_rows(msg.role, msg.text)

    def _user_codes(self, s: Session, codes: list[int], commit: bool) -> None:
        s.pending_codes += codes
        s.pending_commit = s.pending_commit or commit
        s.turn_codes += len(codes)
        sent = self._pump(s)
        self._send(s.owner, m.UserAudioProgress(s.session_id, s.turn_codes, sent))

    def _pump(self, s: Session) -> int:
        """Move pending speech codes into the engine; returns the rows of the user turn sent so far."""
        t = s.active
        if t is None and s.pending_codes:
            lead = s.close_rows + self._system_rows(s, "audio") + s.pending_rows
            rows = lead + self.prompts.audio_turn_open_rows() + self.prompts.audio_code_rows(s.pending_codes)
            if s.pending_commit:
                rows += self.prompts.audio_turn_close_rows()
            rid = s.new_request_id()
            params = s.sampling or SamplingParams()
            base = self.engine.conversation_rows(s.conversation_id)
            rerun = self.engine.conversation_unrun_rows(s.conversation_id)
            self.engine.add_request(rid, rows, params, conversation_id=s.conversation_id, input_done=False)
            t = Turn(rid, base, params, close_rows=s.close_rows, carried_rows=s.pending_rows,
                     system_included=not s.system_sent, codes=list(s.pending_codes),
                     audio_open=not s.pending_commit, committed=s.pending_commit, rows_added=len(rows),
                     rerun_rows=rerun, user_rows_start=len(lead))
            s.active = t
            self._requests[rid] = (s, t)
            s.close_rows, s.pending_rows, s.system_sent = [], [], True
            s.pending_codes, s.pending_commit = [], False
        elif t is not None and t.audio_open and t.undo is None:
            rows = self.prompts.audio_code_rows(s.pending_codes)
            if s.pending_commit:
                rows += self.prompts.audio_turn_close_rows()
            if rows:
                self.engine.append_input(t.request_id, rows, input_done=False)
                t.rows_added += len(rows)
                t.codes += s.pending_codes
            if s.pending_commit:
                t.audio_open, t.committed = False, True
            s.pending_codes, s.pending_commit = [], False
        elif s.pending_commit:
            # A response or an undo is in flight: the committed turn waits whole.
            s.pending_rows += self.prompts.user_audio_turn_rows(s.pending_codes)
            s.pending_codes, s.pending_commit = [], False
        t = s.active
        if t is None or t.response is not None or not t.codes:
            return 0
        return t.rows_added - t.user_rows_start

    # ---- responses ----------------------------------------------------------------------

    def _on_CreateResponse(self, client: bytes, msg: m.CreateResponse) -> None:
        s = self._session(client, msg.session_id)
        try:
            self._create(s, msg)
        except Exception as e:  # noqa: BLE001 - whatever the fault, this response ends with ResponseDone
            if isinstance(e, ServiceError | EngineError):
                code = e.code
            elif isinstance(e, ValueError):  # ConfigError included: bad sampling values
                code = errors.INVALID_REQUEST
            else:
                code = errors.ENGINE_ERROR
                log.exception("CreateResponse %s failed", msg.response_id)
            self._send(client, m.Error(s.session_id, code, str(e), msg.response_id))
            self._send(client, m.ResponseDone(s.session_id, msg.response_id, "failed", reason=code))

    def _create(self, s: Session, msg: m.CreateResponse) -> None:
        params = sampling_params(msg.sampling)
        t = s.active
        if s.completing is not None or (
                t is not None and (t.undo is not None or (t.response is not None and t.response.cancelled))):
            s.deferred.append(msg)  # runs when the abort in flight is reported, or the last answer is done
            return
        if t is not None and t.response is not None:
            raise ServiceError(errors.INVALID_REQUEST, f"response {t.response.response_id!r} is still in progress")
        if t is not None and t.audio_open:
            raise ServiceError(errors.INVALID_REQUEST,
                               "commit or clear the input audio buffer before creating a response")
        if t is not None and params != t.params and not self._prompt_settled(s, t, msg.modality):
            # The open request's system turn was chosen for the other modality: prefill the user turn
            # again (same rows, the system prompt for this answer) with the new settings.
            s.sampling = params
            t.undo = "requeue"
            self.engine.abort(t.request_id)
            s.deferred.append(msg)
            return
        prefix = self.prompts.assistant_prefix_rows(msg.modality)
        stream = None
        if msg.modality == "audio" and self.decoder is not None:
            stream = self.decoder.open_stream(s.session_id, voice=s.voice, seed=params.seed or 0)
        try:
            t = self._submit_response(s, t, params, msg, prefix)
        except BaseException:
            if stream is not None and hasattr(stream, "close"):
                stream.close()
            raise
        s.sampling = params
        s.answer = None
        r = ResponseState(msg.response_id, msg.modality, time.monotonic(), prompt_rows=t.rows_added + t.rerun_rows,
                          cached_rows=t.base_rows - t.rerun_rows, prefix_last_row=prefix[-1],
                          detok=IncrementalDetokenizer(self.tokenizer), decoder_stream=stream)
        t.response = r
        if s.commit_at is not None:  # where the user turn's end went before this answer (stage marks, < 0)
            r.mark("commit_in", s.commit_at)
            r.mark("commit_call", s.commit_call_at)
            r.mark("commit_encoded", s.commit_done_at)
            s.commit_at = s.commit_call_at = s.commit_done_at = None
        self._send(s.owner, m.ResponseStarted(s.session_id, msg.response_id, r.prompt_rows))

    @staticmethod
    def _prompt_settled(s: Session, t: Turn, modality: m.Modality) -> bool:
        """True when the open turn's rows fit this answer as they are: no default system prompt went in
        with it, or it was the spoken one and the answer is spoken. New sampling settings then go in with
        the closing rows (Engine.append_input(params=)) instead of a second prefill."""
        return not t.system_included or s.instructions is not None or modality == "audio"

    def _submit_response(self, s: Session, t: Turn | None, params: SamplingParams, msg: m.CreateResponse,
                         prefix: list[Row]) -> Turn:
        """The response's rows into the engine: appended to the open user turn, or a new request."""
        if t is not None:
            rows = s.pending_rows + prefix
            self.engine.append_input(t.request_id, rows, input_done=True,
                                     params=params if params != t.params else None)
            t.params = params
            t.carried_rows = t.carried_rows + s.pending_rows
            s.pending_rows = []
            t.rows_added += len(rows)
        else:
            rows = s.close_rows + self._system_rows(s, msg.modality) + s.pending_rows + prefix
            rid = s.new_request_id()
            base = self.engine.conversation_rows(s.conversation_id)
            rerun = self.engine.conversation_unrun_rows(s.conversation_id)
            self.engine.add_request(rid, rows, params, conversation_id=s.conversation_id, input_done=True)
            t = Turn(rid, base, params, close_rows=s.close_rows, carried_rows=s.pending_rows,
                     system_included=not s.system_sent, rows_added=len(rows), rerun_rows=rerun)
            s.active = t
            self._requests[rid] = (s, t)
            s.close_rows, s.pending_rows, s.system_sent = [], [], True
        return t

    def _on_CancelResponse(self, client: bytes, msg: m.CancelResponse) -> None:
        s = self._session(client, msg.session_id)
        t = s.active
        if t is not None and t.response is not None and t.response.response_id == msg.response_id:
            if not t.response.cancelled:
                t.response.cancelled = True
                self.engine.abort(t.request_id)
            return
        if s.completing is not None and s.completing.response_id == msg.response_id:
            self._drop_last_audio(s.completing)
            return
        if msg.response_id in self._finished_ids or any(d.response_id == msg.response_id for d in s.deferred):
            s.deferred = [d for d in s.deferred if d.response_id != msg.response_id]
            return  # finished already (a benign race), or not started: nothing to stop
        raise ServiceError(errors.INVALID_REQUEST, f"no response {msg.response_id!r} in this session", msg.response_id)

    def _on_TruncateResponse(self, client: bytes, msg: m.TruncateResponse) -> None:
        s = self._session(client, msg.session_id)
        t = s.active
        if t is not None and t.response is not None and t.response.response_id == msg.response_id:
            t.response.truncate_samples = msg.audio_samples_played
            if not t.response.cancelled:
                t.response.cancelled = True
                self.engine.abort(t.request_id)
            return
        a = s.answer
        if a is None or a.response_id != msg.response_id:
            raise ServiceError(errors.INVALID_REQUEST, f"response {msg.response_id!r} is not the latest answer of this "
                               "session (only that one can be truncated)", msg.response_id)
        if s.completing is not None and s.completing.response_id == msg.response_id:
            self._drop_last_audio(s.completing)  # the client stopped playing it
        keep = a.cut(msg.audio_samples_played)
        if keep is None:
            return
        cut_rows, last = a.gen_start + keep, a.last_row(keep)
        a.rows, a.code_idx = a.rows[:keep], [i for i in a.code_idx if i < keep]
        if t is None:
            self.engine.truncate_conversation(s.conversation_id, cut_rows)
            s.close_rows = self.prompts.assistant_close_rows(last)
            return
        # A user turn after the answer is already in the engine: undo it, cut, prefill it again.
        t.cut_rows, t.cut_last_row = cut_rows, last
        if t.undo is None:
            t.undo = "requeue"
            self.engine.abort(t.request_id)

    # ---- completion ---------------------------------------------------------------------

    def _finish(self, s: Session, t: Turn, o: StepOutput) -> None:
        self._requests.pop(t.request_id, None)
        if s.active is t:
            s.active = None
        if t.undo == "close" or self.sessions.get(s.session_id) is not s:
            self._release(s)
            return
        if t.undo is not None and t.response is None:
            self._undo(s, t)
        elif t.response is not None:
            self._finish_response(s, t, t.response, o)
        self._pump(s)
        deferred, s.deferred = s.deferred, []
        for d in deferred:
            self._on_CreateResponse(s.owner, d)

    def _undo(self, s: Session, t: Turn) -> None:
        if t.cut_rows is not None:
            self.engine.truncate_conversation(s.conversation_id, t.cut_rows)
            s.close_rows = self.prompts.assistant_close_rows(t.cut_last_row)
        else:
            self.engine.truncate_conversation(s.conversation_id, t.base_rows)
            s.close_rows = t.close_rows
            if t.system_included:
                s.system_sent = False
        restored = list(t.carried_rows)
        if t.undo == "requeue":
            if t.committed:
                restored += self.prompts.user_audio_turn_rows(t.codes)
            else:
                s.pending_codes = t.codes + s.pending_codes
        s.pending_rows = restored + s.pending_rows

    def _finish_response(self, s: Session, t: Turn, r: ResponseState, o: StepOutput) -> None:
        stream, r.decoder_stream = r.decoder_stream, None
        last_codes: list[int] = []
        if stream is not None:
            # The answer's last codes, its final partial chunk and the vocoder tail: on the codec worker this
            # queues behind the stream's earlier chunks, and the engine keeps stepping meanwhile (a long answer's
            # undecoded codes are seconds of codec work); ResponseDone follows the audio.
            last_codes = [] if r.cancelled else r.new_codes
            r.new_codes = []
        self._text(s, r, r.detok.flush())
        gen_start = self.engine.conversation_rows(s.conversation_id) - len(r.rows)
        a = Answer(r.response_id, gen_start, r.rows, r.code_idx, r.prefix_last_row)
        keep = a.cut(r.truncate_samples) if r.truncate_samples is not None else None
        if keep is not None:
            self.engine.truncate_conversation(s.conversation_id, gen_start + keep)
            a.rows, a.code_idx = a.rows[:keep], [i for i in a.code_idx if i < keep]
        s.close_rows = self.prompts.assistant_close_rows(a.last_row(len(a.rows)))
        s.answer = a
        self._finished_ids.append(r.response_id)
        reason = o.finish_reason
        status, why = {"stop": ("completed", None), "length": ("incomplete", "max_output_tokens"),
                       "abort": ("cancelled", "client_cancelled")}.get(reason, ("failed", reason))
        r.done = (status, why)
        if stream is None:
            self._complete(s, r)
        else:
            s.completing = r
            self._codec_owner[id(r)] = s
            self._codec.push(r, stream, last_codes, final=True)
            if r.cancelled:
                self._codec.cancel(r)

    def _drop_last_audio(self, r: ResponseState) -> None:
        """A finished answer whose last audio is still decoding will not be heard: send none, decode no more."""
        r.cancelled = True
        if self._codec is not None:
            self._codec.cancel(r)

    def _complete(self, s: Session, r: ResponseState) -> None:
        """ResponseDone once the answer's last audio is out; then any response asked for meanwhile."""
        status, why = r.done
        if r.cancelled:
            status, why = ("failed", errors.ENGINE_ERROR) if r.failed else ("cancelled", "client_cancelled")
        if r.ttfa_ms is not None:
            log.info("response %s: first audio at %.1f ms; stages %s", r.response_id, r.ttfa_ms, r.marks)
        if self.sessions.get(s.session_id) is not s:  # closed meanwhile: nobody to tell
            return
        self._send(s.owner, m.ResponseDone(
            s.session_id, r.response_id, status, reason=why, output_rows=len(r.rows), prompt_rows=r.prompt_rows,
            cached_rows=r.cached_rows, audio_samples=r.audio_samples, text="".join(r.text),
            engine_ttfa_ms=r.ttfa_ms))
        if s.completing is r:
            s.completing = None
            if s.active is None and self.sessions.get(s.session_id) is s:
                deferred, s.deferred = s.deferred, []
                for d in deferred:
                    self._on_CreateResponse(s.owner, d)

