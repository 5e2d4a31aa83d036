"""The engine service without its socket: session messages in, engine calls, session messages out.

`Service.handle(client, msg)` and `Service.step()` return `(client, message)` pairs to send; the
client is the ZeroMQ identity that opened the session (loop.py routes them). Everything here
runs on one thread, between engine steps (`handle_early` and `while_stepping` also while a step's tokens are on
the GPU, touching no engine request).

Rules the server can rely on:
- Every message about an unknown session, or a session opened by another client, gets
  `Error(code=errors.INVALID_REQUEST)`. Engine errors keep their `code` (engines/api.py). No error ends
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
- A message over one of a session's bounds (limits.py: a text's length, the rows of items waiting for the next
  answer, `max_new_tokens`) gets `Error(input_too_large)` and changes nothing. A turn that could never get its KV
  blocks while other conversations keep their histories gets `Error(server_busy)`, its answer fails, and its rows
  wait in the session for the next answer (engines/lm/scheduler.py).
- A voice prompt (`voice_wav`) outside the bounds of engines/audio/voice_prompt.py (sample rate, duration) is
  refused from its header with `Error(invalid_audio)` and the message changes nothing. Any other is made on the
  voice worker's thread (voice_worker.py), never on this loop; the session's answers wait for it, and a recording it
  cannot use gets `Error(invalid_audio)` then, the voice staying as it was. UpdateSession(default_voice=True) goes
  back to the codec's default voice; a prompt still in the making no longer counts.
- The system turn goes in with the first rows sent: `instructions`, else the default prompt for
  the first response's modality (the spoken one when user speech comes first). New instructions
  after that are added as another system turn (UpdateSession(default_instructions=modality): that
  modality's default prompt, the session having none again).
- A CommitUserAudio with `transcribe` gets TranscriptionDelta messages and one TranscriptionDone for its item
  (transcripts.py); the transcription never touches a conversation and runs only on what answers leave. A
  tentative commit's turn is transcribed once it stands (ConfirmUserAudio, or the next commit), never if withdrawn.
- DeleteItem (between turns only, a tentative commit not yet confirmed included, else ITEM_DELETE_MID_TURN) and the
  oldest items dropped when a request would not fit max_model_len (SetTruncation; by default down to
  AUTO_RETENTION of it; never while a tentative commit may be withdrawn) are answered by ItemsDropped
  (history.py); the system turn and system items are never dropped to fit. A withdrawn answer's item leaves the
  history with its rows; items added since (waiting for the next answer) stay.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engines.api import EngineError, InvalidRequestError, StepOutput
from engines.audio.voice_prompt import check_voice_prompt
from engines.audio.wav import AudioFormatError
from engines.config import ConfigError
from engines.kernels.tuning import device_name
from engines.process.codec_worker import CodecWorker
from engines.process.encoder_worker import EncoderWorker
from engines.process.errors import ServiceError
from engines.process.history import History
from engines.process.limits import InputLimits
from engines.process.observe.spans import Spans
from engines.process.outputs import Out, Outputs
from engines.process.prompt import PromptBuilder
from engines.process.responses import Responses, sampling_params
from engines.process.sessions import ResponseState, Session, Turn
from engines.process.tokenizer import TextTokenizer
from engines.process.transcripts import Transcript, Transcripts
from engines.process.user_input import UserInput
from engines.process.voice_worker import VoiceWorker
from engines.protocol import errors
from engines.protocol import messages as m

log = logging.getLogger("engines.process")

SLOW_STEP_S = 0.1
STEP_MS_WEIGHT = 0.1  # the weight of the latest step in the recent step time the engine reports


class Service(UserInput, Responses, History, Transcripts, Outputs):
    """Session messages in, engine calls, session messages out (module doc). Its parts: the entry points, the
    dispatch and the session messages here; the user's audio, commits and text items in user_input.py (with
    handle_early, for those that arrive while a step runs); responses and the engine's finished requests in
    responses.py; the history's items (deleted, or dropped to fit the context) in history.py; transcriptions of
    user turns in transcripts.py; what goes out (text deltas, audio through the codec worker) in outputs.py.
    Start-up turns: warm_up.py."""

    def __init__(self, engine: Any, tokenizer: TextTokenizer, encoder: Any = None, decoder: Any = None,
                 voice_loader: Callable[[bytes], Any] | None = None, encode_every_s: float = 0.0,
                 first_decoders: Sequence[Any] = (),
                 encoder_thread: bool = False, codec_round_max: int | None = None,
                 codec_round_period_s: float = 0.0, limits: InputLimits = InputLimits()) -> None:
        """`encoder`: has `open_stream()` -> stream with `push(pcm16k float32) -> codes`, `finalize(last)`.
        `decoder` (engines.speech_out.CodecDecoder): has `open_stream(session_id, voice=, seed=)` -> stream
        with `add(codes)`, `take_jobs(finishing=)` and `close()`, and `run_jobs(jobs)` -> PCM (24 kHz float32) of
        chunks of many streams in one batch. Speech is decoded on the codec worker's thread (its own CUDA streams on
        a GPU) while the engine steps (engines/process/codec_worker.py). `voice_loader`: WAV bytes -> the decoder's
        speaker prompt (raises ValueError for a bad recording), run on a thread of its own (voice_worker.py); without
        it a session's voice_wav is refused.
        `encode_every_s`: user audio of every session is held and encoded together, in one batched encoder
        call, at most this often (0: at the end of each batch of messages); commits of several sessions are
        finalized in one call. Codes are the same either way (the encoder streams exactly). `encoder_thread`: those
        calls run on a thread of their own, beside the engine steps (engines/process/encoder_worker.py).
        `first_decoders`: lanes of `decoder` (CodecDecoder.lane) on which the codec worker decodes first chunks
        beside its other rounds.
        `codec_round_max`: most playing answers in one of the worker's rounds (None: its BULK_MAX).
        `codec_round_period_s` (with first lanes): the worker's rounds of playing answers start at most this often,
        each with every answer due before the next (0: back to back).
        `limits`: what one session may hand over (limits.py)."""
        self.engine = engine
        self.voice_loader = voice_loader
        self.limits = limits
        self._voices = None if voice_loader is None else VoiceWorker(voice_loader)
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer)
        self.encoder = encoder
        self.decoder = decoder
        self.sessions: dict[str, Session] = {}
        self._requests: dict[str, tuple[Session, Turn]] = {}
        self._transcripts: dict[str, Transcript] = {}
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
        # More rows than the model's context can never go in one request (limits.py)
        self.max_waiting_rows = None if config is None else config.max_model_len
        self._finished_ids: deque[str] = deque(maxlen=64)
        self._unstarted_ids: deque[str] = deque(maxlen=64)
        self._out: list[Out] = []
        # Set by the engine process: called again and again while the engine waits for a step's tokens, until it
        # returns False (Engine.step's `on_wait`; it calls handle_early and while_stepping).
        self.step_wait: Callable[[], bool] | None = None
        self.spans = Spans()  # where the loop's time goes, per message kind and step part (the load log)
        self._step_ms = 0.0  # recent time of a step that ran rows (an average over ~10), for the server's placement

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

    def _dispatch(self, client: bytes, msg: Any) -> None:
        handler = getattr(self, "_on_" + type(msg).__name__, None)
        if handler is None:
            self._send(client, m.Error(getattr(msg, "session_id", None), errors.INVALID_REQUEST,
                                       f"{type(msg).__name__} is not a request to the engine"))
            return
        with self.spans.span(type(msg).__name__):
            self._guard(client, msg, handler, client, msg)

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
                or (self._codec is not None and self._codec.busy())
                or (self._voices is not None and self._voices.busy()))

    def step(self) -> list[Out]:
        """One engine step; its rows become deltas, audio chunks and completions."""
        t0 = time.perf_counter()
        self._collect_voices()
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
        if outputs:
            self._step_ms += STEP_MS_WEIGHT * ((t2 - t1) * 1e3 - self._step_ms)
        finished: list[tuple[Session, Turn, StepOutput]] = []
        live: list[tuple[Session, ResponseState]] = []
        for o in outputs:
            entry = self._requests.get(o.request_id)
            if entry is None:
                self._transcript_row(o)
                continue
            s, t = entry
            r = t.response
            if r is not None and o.finish_reason not in ("abort", "no_kv"):  # those outputs carry no row
                r.add_row(o.text_token, o.audio_token, o.mode)
                r.mark("first_row")
                if len(r.code_idx) >= r.first_audio_codes:
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

    def while_stepping(self) -> list[Out]:
        """What can be sent while the engine waits for a step's tokens (from inside Engine.step's `on_wait`): PCM the
        codec worker has posted, instead of after the step (under load a step takes ~10 ms, and an answer's first
        chunk waited half of that on average), and whatever this step produced so far. Only plain audio: an answer's
        last result or a failure changes sessions and the engine, and waits for the step's end."""
        self._collect_decoded(audio_only=True)
        return self._take()

    def stats(self) -> dict[str, Any]:
        st = self.engine.stats()
        return {"running": st.running, "waiting": st.waiting, "kv_free": st.free_blocks, "kv_total": st.total_blocks,
                "step_ms": round(self._step_ms, 3) if st.running else 0.0,
                "steps": st.steps, "prefilled_rows": st.prefilled_rows, "decoded_rows": st.decoded_rows,
                "sessions": len(self.sessions), "device_name": self.device_name, **self._capacity,
                **self._decoder_pages()}

    def _decoder_pages(self) -> dict[str, int]:
        """The full-context decoder's cache (absent with the windowed flow or no decoder)."""
        full = getattr(self.decoder, "full", None)
        if full is None:
            return {}
        return {"decoder_pages_free": full.pages.n_free, "decoder_pages_total": full.pages.n_pages,
                "decoder_pages_kept": full.kept_pages, "decoder_pages_forgotten": full.forgotten}

    def _session(self, client: bytes, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise ServiceError(errors.INVALID_REQUEST, f"unknown session {sid!r}")
        if s.owner != client:
            raise ServiceError(errors.INVALID_REQUEST, f"session {sid!r} belongs to another client")
        return s

    # ---- session lifecycle --------------------------------------------------------------

    def _on_OpenSession(self, client: bytes, msg: m.OpenSession) -> None:
        if msg.session_id in self.sessions:
            raise ServiceError(errors.INVALID_REQUEST, f"session {msg.session_id!r} is already open")
        if self.engine.conversation_rows(msg.session_id):
            raise ServiceError(errors.INVALID_REQUEST, f"session {msg.session_id!r} is still closing")
        self._check_voice(msg.voice_wav)
        self.limits.check_text("instructions", msg.instructions)
        if msg.sampling is not None:
            self.limits.check_output(msg.sampling.max_new_tokens)
        s = Session(msg.session_id, client, instructions=msg.instructions,
                    sampling=sampling_params(msg.sampling) if msg.sampling else None)
        self.sessions[msg.session_id] = s
        if msg.voice_wav is not None:
            self._submit_voice(s, msg.voice_wav)
        self._send(client, m.SessionReady(msg.session_id))

    def _on_UpdateSession(self, client: bytes, msg: m.UpdateSession) -> None:
        s = self._session(client, msg.session_id)
        self._check_voice(msg.voice_wav)  # first: a bad update changes nothing
        self.limits.check_text("instructions", msg.instructions)
        if msg.sampling is not None:
            self.limits.check_output(msg.sampling.max_new_tokens)
        if msg.sampling is not None:
            s.sampling = sampling_params(msg.sampling)
        if msg.instructions is not None and msg.instructions != s.instructions:
            self._new_instructions(s, msg.instructions, "audio", msg.pinned)
        elif msg.instructions is None and msg.default_instructions is not None and s.instructions is not None:
            self._new_instructions(s, None, msg.default_instructions, msg.pinned)
        if msg.voice_wav is not None:
            self._submit_voice(s, msg.voice_wav)  # from the next response on
        elif msg.default_voice:
            self._default_voice(s)
        self._send(client, m.SessionReady(msg.session_id))

    def _new_instructions(self, s: Session, text: str | None, modality: m.Modality, pinned: bool) -> None:
        """None: the default system prompt of `modality`. Before the first rows they are the system turn itself."""
        s.instructions = text
        if s.system_sent:
            s.pending_rows += self.prompts.system_rows(text, modality)
            self._add_item(s, None, pinned=pinned)

    def _check_voice(self, wav: bytes | None) -> None:
        """Refuse a prompt from its header alone (rate, duration: engines/audio/voice_prompt.py), before any work."""
        if wav is None:
            return
        if self._voices is None:
            raise ServiceError(errors.INVALID_REQUEST, "this engine cannot use voice prompts (no codec loaded)")
        try:
            check_voice_prompt(wav)
        except AudioFormatError as e:
            raise ServiceError(errors.INVALID_AUDIO, f"voice_wav: {e}") from None

    def _submit_voice(self, s: Session, wav: bytes) -> None:
        """The prompt is made on the voice worker; the session's answers wait for it (Responses._create)."""
        s.voice_job += 1
        s.voice_waiting = True
        self._voices.submit(s.session_id, s.voice_job, wav)

    def _default_voice(self, s: Session) -> None:
        """The codec's default voice from the next response on; a prompt in the making no longer counts, and the
        answers that waited for it go ahead."""
        s.voice_job += 1
        s.voice, s.voice_wav = None, None
        if s.voice_waiting:
            s.voice_waiting = False
            self._run_deferred(s)

    def _run_deferred(self, s: Session) -> None:
        deferred, s.deferred = s.deferred, []
        for d in deferred:
            self._on_CreateResponse(s.owner, d)

    def _collect_voices(self) -> None:
        """Prompts the voice worker made: each session's latest becomes its voice (a recording it could not use is
        refused with an Error, and the voice stays as it was); then the answers that waited for it."""
        if self._voices is None:
            return
        for r in self._voices.take_results():
            s = self.sessions.get(r.key)
            if s is None or r.job != s.voice_job:
                continue  # closed, or a later prompt replaced it
            s.voice_waiting = False
            if isinstance(r.voice, ValueError):
                self._send(s.owner, m.Error(s.session_id, errors.INVALID_AUDIO, str(r.voice)))
            elif isinstance(r.voice, Exception):
                log.error("voice prompt of session %s failed: %s: %s", s.session_id, type(r.voice).__name__, r.voice)
                code = r.voice.code if isinstance(r.voice, EngineError) else errors.ENGINE_ERROR
                self._send(s.owner, m.Error(s.session_id, code, f"voice prompt failed: {type(r.voice).__name__}: "
                                                                 f"{r.voice}"))
            else:
                s.voice, s.voice_wav = r.voice, r.wav
            self._run_deferred(s)

    def _on_CloseSession(self, client: bytes, msg: m.CloseSession) -> None:
        s = self._session(client, msg.session_id)
        del self.sessions[msg.session_id]
        if self._speech is not None:
            self._speech.drop(s.session_id)
        if self._voices is not None:
            self._voices.drop(s.session_id)
        if s.completing is not None:
            self._drop_last_audio(s.completing)
        self._drop_transcripts(s)
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

    def _on_Sync(self, client: bytes, msg: m.Sync) -> None:
        self._send(client, m.Synced(msg.session_id, msg.seq))

    def _on_Ping(self, client: bytes, msg: m.Ping) -> None:
        self._send(client, m.Pong(msg.nonce, self.stats()))
