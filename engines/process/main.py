"""The engine process: owns the GPU, serves session messages over a ZeroMQ ROUTER socket.

    python -m engines.process.main --model tiny-random|PATH --codec tiny-random|PATH \\
        --device cpu|cuda[:N] --endpoint ipc:///tmp/moss.sock|tcp://127.0.0.1:PORT \\
        [--vocoder bigvgan|hift] [--ready-file PATH]

Wire: clients connect DEALER sockets (several server processes may share one engine); each frame
is one msgpack message of engines.protocol.messages (a REQ-style empty delimiter frame is accepted
and echoed). Replies about a session go to the client that opened it; Pong and errors about
malformed frames go to the sender. A bad message never ends the process: it is answered with
`Error` (see core.py for the per-message rules).

Readiness: the model, tokenizer and codec are loaded BEFORE the socket is bound, so the first
`Pong` means "ready" (a Ping sent earlier waits in the client's queue until then). Also, once
bound, the process logs `engine ready endpoint=...` on stderr and, with `--ready-file`, writes
that file (JSON: pid, endpoint, model, codec, device).

Loop: poll without blocking while the engine has work, else wait up to 50 ms; each iteration drains
every waiting message, then runs one engine step and sends what it produced. While the step runs on the GPU
the loop keeps polling: decoded audio the codec worker posts meanwhile is sent, and user audio and commits that
arrive go to the encoder's thread at once (other messages wait for the step's end). SIGTERM or SIGINT ends
the loop after the current step. A client that sends nothing (not even its once-a-second Ping) for
`--client-timeout-s` is taken for dead (a server worker killed, a host gone): its sessions are
closed as if it had sent CloseSession, so their KV blocks return to the pool. When idle (at most
every 10 s, after work) the KV pool's integrity is checked. An exception inside an engine step (or a
failed check) leaves the engine's state unknown: every session with a live response gets
`Error(engine_error)` and `ResponseDone(failed)`, and the process exits with status 1 so the
supervisor restarts it.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from engines.api import step_row_labels
from engines.lm.kv.sizing import GIB
from engines.process.observe.spans import Spans
from engines.process.observe.stall_watch import StallWatch
from engines.process.observe.startup_memory import StartupMemory
from engines.process.options import CLIENT_TIMEOUT_S, add_arguments
from engines.process.service import SLOW_STEP_S as SLOW_S
from engines.process.service import Out, Service
from engines.protocol import errors
from engines.protocol import messages as m

if TYPE_CHECKING:
    from engines.config import EngineConfig

log = logging.getLogger("engines.process")

IDLE_POLL_MS = 50
WAIT_POLL_MS = 2
INTEGRITY_EVERY_S = 10.0
LOAD_LOG_S = 5.0
MAX_DRAIN = 1024  # messages handled between two engine steps, so a flood cannot stall decoding
# While the engine waits for a step's tokens, decoded audio leaves and user audio and commits reach the encoder
# (EngineServer._while_stepping): the loop looks for them this often (a step takes ~5-12 ms under load).
STEP_POLL_S = 0.0002


def _free_bytes(device: str) -> int:
    """Device memory free for the KV pool: the driver's, once torch's allocator has returned its unused blocks. (What
    it keeps inside CUDA graphs' private pools is not free for other tensors: counting it, an H100 ran out.)"""
    import torch

    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _load_codec(args: argparse.Namespace, config: EngineConfig, memory: StartupMemory) -> tuple[Any, Any, Any]:
    """The speech encoder, the codec decoder and its first-chunk lanes (none off a GPU or without --first-lane),
    with their KV slots and CUDA graphs on a GPU."""
    from engines.speech_in import SpeechEncoder
    from engines.speech_out.decoder import CodecDecoder

    on_gpu = args.device.startswith("cuda")
    first_decoders = []
    vocoder = args.vocoder
    if vocoder is None:
        vocoder = "hift" if Path(args.codec).is_dir() and not (Path(args.codec) / "bigvgan").is_dir() else "bigvgan"
    with memory.part("the speech encoder"):
        encoder = SpeechEncoder.load(args.codec, device=args.device, tf32=getattr(args, "encoder_tf32", False))
    if on_gpu:
        # KV slots for every sequence the engine runs: growing the pool under load (it doubles) stalls the
        # engine loop for the allocation and copy.
        n = config.max_running
        with memory.part(f"the speech encoder's KV slots for {n} streams "
                         f"({encoder.runner.kv.slot_bytes() / 2**20:.0f} MiB each)"):
            encoder.reserve(n)
        if getattr(args, "encoder_graphs", True):  # after the reserve: a growth of the KV pool retires them
            with memory.part("the speech encoder's CUDA graphs"):
                encoder.capture_graphs()
    # On the GPU the flow's encoder and Euler solve are launch-bound: replay them as CUDA graphs, estimator
    # in bf16, the encoder's float32 matmuls on TF32.
    with memory.part("the codec decoder"):
        decoder = CodecDecoder.load(args.codec, device=args.device, vocoder=vocoder, seed=args.seed,
                                    cuda_graphs=on_gpu, encoder_graphs=on_gpu, encoder_tf32=on_gpu,
                                    estimator_dtype="bfloat16" if on_gpu else "float32")
    first_lane = _first_lane_on(args, on_gpu)
    if first_lane:  # rounds of playing answers yield between the pieces of their solve (codec_worker)
        from engines.process.codec_worker import FIRST_MAX, PLAYING_SOLVE_PARTS

        decoder.flow.solve_parts = PLAYING_SOLVE_PARTS
    with memory.part(f"the codec's CUDA graphs for batches of up to {config.max_running}"):
        # Every running sequence may be a speaking session in one codec batch: capture those graphs now.
        decoder.capture_graphs(config.max_running)
        for _ in range(getattr(args, "first_lanes", 2) if first_lane else 0):
            lane = decoder.lane()
            lane.flow.solve_parts = 1  # first chunks never yield: one graph per solve
            lane.capture_graphs(FIRST_MAX)
            first_decoders.append(lane)
    return encoder, decoder, first_decoders


def _first_lane_on(args: argparse.Namespace, on_gpu: bool) -> bool:
    """--first-lane as given, else on a GPU."""
    first_lane = getattr(args, "first_lane", None)
    return on_gpu if first_lane is None else first_lane


def build_service(args: argparse.Namespace) -> Service:
    from engines.config import ConfigError, EngineConfig, model_config_for
    from engines.lm.engine import Engine
    from engines.lm.kv.sizing import thin_pool_warning
    from engines.process.tokenizer import load_tokenizer

    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("float32" if args.device == "cpu" else model_config_for(args.model).torch_dtype)
    kw: dict[str, Any] = {"device": args.device, "dtype": dtype}
    on_gpu = args.device.startswith("cuda")
    kv_auto = args.kv_cache_gib == "auto" or (args.kv_cache_gib is None and on_gpu)
    if kv_auto and not on_gpu:
        raise ConfigError(f"--kv-cache-gib auto sizes the pool from a GPU's free memory; give GiB on {args.device}")
    if isinstance(args.kv_cache_gib, float):
        kw["kv_cache_bytes"] = int(args.kv_cache_gib * GIB)
    if args.max_running is not None:
        kw["max_running"] = args.max_running
        kw["prefill_token_budget"] = max(EngineConfig.prefill_token_budget, 2 * args.max_running)
    if getattr(args, "step_rows", None) is not None:
        running = kw.get("max_running", EngineConfig.max_running)
        if args.step_rows <= running:
            raise ConfigError(f"--step-rows {args.step_rows} must exceed the sequences one step may decode "
                              f"(--max-running {running}), so that prefill always makes progress beside them")
        kw["prefill_token_budget"] = args.step_rows
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    if getattr(args, "ramp_step_rows", None) is not None:
        kw["ramp_step_rows"] = args.ramp_step_rows
    kw["fp8_weights"] = getattr(args, "fp8_weights", False)
    kw["fp8_only"] = getattr(args, "fp8_only", False)
    kw["kv_dtype"] = getattr(args, "kv_dtype", "auto")
    config = EngineConfig(**kw)
    encoder_thread = on_gpu if getattr(args, "encoder_thread", None) is None else args.encoder_thread
    if getattr(args, "encoder_tf32", False) and not on_gpu:
        raise ValueError(f"--encoder-tf32 needs a CUDA device (got --device {args.device})")
    round_period_s = getattr(args, "codec_round_period_ms", 200.0) / 1000
    if (getattr(args, "codec_round_max", None) is not None and args.codec != "none" and _first_lane_on(args, on_gpu)
            and round_period_s > 0):
        raise ValueError("--codec-round-max bounds rounds of playing answers run back to back; with a first lane they "
                         "run once a period (--codec-round-period-ms) and take every answer due: give "
                         "--codec-round-period-ms 0 with it")
    if on_gpu:
        import torch

        from engines.cuda.streams import model_stream

        # The language model's steps run on a high-priority stream, so they never queue behind the codec
        # worker's rounds of playing answers (lowest priority) for SMs: a decode step is a few ms of GPU work
        # that every session waits for. (The speech encoder's commits and the first-chunk lanes have streams one
        # level above it: engines.cuda.streams.model_stream.)
        torch.cuda.set_stream(model_stream(args.device))
    # The codec and encoder worker threads run Python between their GPU waits; a short switch interval keeps the
    # engine loop from waiting up to 5 ms (the default) for the GIL after each of its own waits.
    sys.setswitchinterval(0.0005)
    t0 = time.monotonic()
    memory = StartupMemory(args.device)
    # The model's KV pool last: with --kv-cache-gib auto it takes what the device has left after the weights and the
    # codec. (The weights first: building random ones takes more than they keep.)
    with memory.part("the language model's weights"):
        model, model_config = Engine.load_weights(args.model, config, seed=args.seed)
    encoder, decoder, first_decoders = _load_codec(args, config, memory) if args.codec != "none" else (None, None, [])
    with memory.part("the language model's KV pool and CUDA graphs"):
        engine = Engine.build(model, model_config, config, seed=args.seed,
                              kv_free_bytes=_free_bytes(args.device) if kv_auto else None)
    del model
    if kv_auto:
        log.info("KV pool: %.1f GiB (auto: the GPU's free memory less a headroom)",
                 engine.config.kv_cache_bytes / GIB)
    thin = thin_pool_warning(engine.config.kv_cache_bytes, engine.config, model_config)
    if thin:
        log.warning("%s", thin)
    tokenizer = load_tokenizer(args.model)
    voices = voice_loader(encoder, args.codec) if encoder is not None else None
    if args.model in ("tiny-random", "full-random") or args.codec in ("tiny-random", "full-random"):
        log.warning("random weights (model=%s codec=%s): answers are noise", args.model, args.codec)
    log.info("loaded model=%s codec=%s device=%s dtype=%s in %.1f s", args.model, args.codec, args.device, dtype,
             time.monotonic() - t0)
    service = Service(engine, tokenizer, encoder, decoder, voices,
                      encode_every_s=getattr(args, "encode_every_ms", 0.0) / 1000,
                      first_decoders=first_decoders, codec_round_max=getattr(args, "codec_round_max", None),
                      codec_round_period_s=round_period_s,
                      encoder_thread=encoder_thread)
    warm_up = on_gpu if getattr(args, "warm_up", None) is None else args.warm_up
    if warm_up and encoder is not None and decoder is not None:
        t1 = time.monotonic()
        with memory.part("the warm-up turns"):
            service.warm_up()
        log.info("warm-up turns in %.1f s", time.monotonic() - t1)
    # Everything loaded so far lives as long as the process: keep it out of every later collection's scan.
    gc.collect()
    gc.freeze()
    from engines.speech_out.chunk_graphs import BucketGraphs

    BucketGraphs.warn_captures = True
    return service


def voice_loader(encoder: Any, codec: str) -> Callable[[bytes], Any]:
    """WAV bytes -> a decoder Voice: codes by our speech encoder, x-vector by the codec's campplus.onnx
    when the codec directory has it (random presets: zero x-vector). Named by content, so the
    decoder's voice cache serves sessions that send the same recording."""
    campplus = Path(codec) / "flow" / "campplus.onnx"
    campplus_path = campplus if campplus.is_file() else None

    def load(wav: bytes) -> Any:
        from engines.speech_out.voice import Voice

        digest = hashlib.sha1(wav).hexdigest()[:16]
        try:
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "voice.wav"
                path.write_bytes(wav)
                voice = Voice.from_wav(path, encode=encoder.encode, campplus=campplus_path)
        except Exception as e:  # noqa: BLE001 - any unreadable recording is one client error
            raise ValueError(f"voice_wav is not a usable recording: {type(e).__name__}: {e}") from None
        return dataclasses.replace(voice, name=f"wav-{digest}")

    return load


def _solves(name: str, decoders: list[Any]) -> str:
    """'; playing solves 27 (3 partial) of 31.2 sessions as 40.1 rows' since the last call (decoders'
    take_counts), or '' with none."""
    cs = [d.take_counts() for d in decoders if hasattr(d, "take_counts")]
    n = sum(c.solves for c in cs)
    if not n:
        return ""
    rows, padded = sum(c.rows for c in cs), sum(c.padded_rows for c in cs)
    return (f"; {name} solves {n} ({sum(c.partial for c in cs)} partial) of {rows / n:.1f} sessions as "
            f"{padded / n:.1f} rows")


class _LoadLog:
    """Where the engine loop's time goes, logged every LOAD_LOG_S while busy (for load tests)."""

    def __init__(self, service: Service, watch: StallWatch) -> None:
        self.service = service
        self.watch = watch  # its wake-up delays: how long the process's threads wait for the GIL
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.t0, self.steps, self.step_s, self.step_max, self.handle_s = now, 0, 0.0, 0.0, 0.0
        self.stats0 = self.service.engine.stats()  # (a copy: the counters at the start of the span)
        codec = self.service._codec
        self.codec0 = (codec.batches, codec.items, codec.busy_s) if codec is not None else None

    def handled(self, dt: float) -> None:
        self.handle_s += dt

    def stepped(self, dt: float) -> None:
        self.steps += 1
        self.step_s += dt
        self.step_max = max(self.step_max, dt)

    def maybe_log(self) -> None:
        now = time.monotonic()
        span = now - self.t0
        if span < LOAD_LOG_S:
            return
        if self.steps:
            st = self.service.engine.stats()
            codec = self.service._codec
            extra = ""
            if late := self.watch.take_wake_delays():
                q = np.percentile(late, [50, 95])
                extra += f"; GIL wait (watch wake-up delay) p50 {q[0]:.2f} / p95 {q[1]:.2f} / max {max(late):.1f} ms"
            if codec is not None and self.codec0 is not None:
                b, n, busy = (codec.batches - self.codec0[0], codec.items - self.codec0[1],
                              codec.busy_s - self.codec0[2])
                extra += f"; codec {b} batches, {n} items, busy {100 * busy / span:.0f}%"
                extra += _solves("playing" if codec.first_decoders else "all", [codec.decoder])
                extra += _solves("first-chunk", codec.first_decoders)
            s0 = self.stats0
            launched = st.steps - s0.steps
            refused = _count_deltas(st.ahead_refused, s0.ahead_refused)
            if refused:
                ramping = _count_deltas(st.ahead_refused_ramping, s0.ahead_refused_ramping)
                extra += "; not launched ahead: " + ", ".join(
                    f"{why} {n} ({ramping.get(why, 0)} ramping)" for why, n in refused.items())
            if launched:
                extra += "; steps by rows " + ", ".join(
                    f"{label}: {n - n0} ({r - r0} rows)" for label, n, n0, r, r0 in zip(
                        step_row_labels(), st.step_row_counts, s0.step_row_counts, st.step_row_sums,
                        s0.step_row_sums, strict=True) if n > n0)
            log.info("load: %d loop steps in %.1f s (%.1f ms mean, %.1f ms max), handling messages %.0f%%, "
                     "stepping %.0f%%; running %d, waiting %d; %d model steps (%d launched ahead) of %.2f decode "
                     "+ %.2f prompt rows, %.1f ms from tokens to the next launch, %.1f ms per launch%s",
                     self.steps, span, 1e3 * self.step_s / self.steps, 1e3 * self.step_max, 100 * self.handle_s / span,
                     100 * self.step_s / span, st.running, st.waiting, launched,
                     st.overlapped_steps - s0.overlapped_steps,
                     (st.decoded_rows - s0.decoded_rows) / max(launched, 1),
                     (st.prefilled_rows - s0.prefilled_rows) / max(launched, 1),
                     1e3 * (st.launch_gap_s - s0.launch_gap_s) / max(st.launch_gaps - s0.launch_gaps, 1),
                     1e3 * (st.launch_s - s0.launch_s) / max(launched, 1), extra)
            parts = self.service.spans.take()
            for worker in (codec, self.service._speech):
                if worker is not None:
                    parts.update(worker.take_spans())
            log.info("load parts: %s", Spans.describe(parts))
        self._reset(now)


def _count_deltas(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Counters that grew since `before`, by how much, largest first."""
    grown = {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}
    return dict(sorted(grown.items(), key=lambda kv: -kv[1]))


class EngineServer:
    """The ROUTER socket around a Service."""

    def __init__(self, service: Service, endpoint: str, ctx: zmq.Context | None = None,
                 client_timeout_s: float = CLIENT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 window: Any = None) -> None:
        if client_timeout_s <= 0:
            raise ValueError(f"client_timeout_s must be > 0, got {client_timeout_s}")
        self.service = service
        service.step_wait = self._while_stepping
        self._later: list[tuple[bytes, Any]] = []  # received during a step, to be handled after it (in order)
        self.endpoint = endpoint
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self._envelopes: dict[bytes, list[bytes]] = {}  # identity -> frames between it and the payload
        self.client_timeout_s = client_timeout_s
        self._clock = clock
        self._last_heard: dict[bytes, float] = {}  # identity -> when its last message arrived
        self._next_expiry = 0.0
        self.stopping = False
        self._last_check = 0.0
        self._busy_since_check = False
        self.watch = StallWatch(threshold_s=SLOW_S)
        self._load = _LoadLog(service, self.watch)
        self.window = window  # a gpu_window.GpuWindow, polled every loop turn

    def close(self) -> None:
        if self.window is not None:
            self.window.finish()
        self.watch.close()
        self.sock.close(0)

    def _send(self, outs: list[Out]) -> None:
        for client, msg in outs:
            frames = [client, *self._envelopes.get(client, []), m.encode(msg)]
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # a client that stopped reading: drop rather than stall every session
                log.warning("dropped %s for a client that does not read", type(msg).__name__)

    def _read(self, most: int) -> list[tuple[bytes, Any]]:
        """Up to `most` waiting messages, decoded (a malformed one is answered here)."""
        items: list[tuple[bytes, Any]] = []
        while len(items) < most:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            client, payload = frames[0], frames[-1]
            self._envelopes[client] = frames[1:-1]
            self._last_heard[client] = self._clock()
            try:
                items.append((client, m.decode(payload)))
            except m.MessageError as e:
                self._send([(client, m.Error(None, errors.INVALID_REQUEST, str(e)))])
        return items

    def _while_stepping(self) -> bool:
        """Engine.step's `on_wait`, on this thread, while the GPU runs a step: user audio and commits that came
        meanwhile go to the encoder, and decoded audio goes out (Service.handle_early, Service.while_stepping); the
        rest of the messages wait for the step's end. Always True: the step's wait goes on polling."""
        if len(self._later) < MAX_DRAIN and self.sock.poll(0, zmq.POLLIN):
            t0 = time.perf_counter()
            items = self._read(MAX_DRAIN - len(self._later))
            try:
                self._later += self.service.handle_early(items)
            except Exception as e:  # noqa: BLE001 - as in _recv_all: a bug on some message must not end the engine
                self._fail_messages(items, e)
            self._load.handled(time.perf_counter() - t0)
        self._send(self.service.while_stepping())
        time.sleep(STEP_POLL_S)
        return True

    def _fail_messages(self, items: list[tuple[bytes, Any]], e: Exception) -> None:
        log.exception("error handling %d messages", len(items))
        self._send([(client, m.Error(getattr(msg, "session_id", None), errors.ENGINE_ERROR, f"{type(e).__name__}: {e}",
                                     getattr(msg, "response_id", None))) for client, msg in items])

    def _recv_all(self) -> None:
        """Drain the socket; decoded messages are handled together (speech is encoded in one batch), after those
        put off during the last step."""
        items, self._later = self._later, []
        items += self._read(MAX_DRAIN - len(items))
        if not items:
            return
        t0 = time.perf_counter()
        try:
            outs = self.service.handle_many(items)
        except Exception as e:  # noqa: BLE001 - a bug on some message must not take the engine down
            self._fail_messages(items, e)
            outs = []
        self._send(outs)
        if time.perf_counter() - t0 > SLOW_S:  # the engine loop waits for this: say what was slow to handle
            kinds: dict[str, int] = {}
            for _, msg in items:
                kinds[type(msg).__name__] = kinds.get(type(msg).__name__, 0) + 1
            log.warning("slow message handling %.0f ms: %s", 1e3 * (time.perf_counter() - t0), kinds)

    def expire_silent_clients(self) -> list[str]:
        """Close every session of a client silent for client_timeout_s; returns the closed session ids."""
        now = self._clock()
        if now < self._next_expiry:
            return []
        self._next_expiry = now + min(1.0, self.client_timeout_s / 4)
        silent = {c for c, t in self._last_heard.items() if now - t > self.client_timeout_s}
        if not silent:
            return []
        for client in silent:
            del self._last_heard[client]
            self._envelopes.pop(client, None)
        closes = [(s.owner, m.CloseSession(sid)) for sid, s in self.service.sessions.items() if s.owner in silent]
        if closes:
            log.warning("%d client(s) silent for over %.0f s: closing their %d session(s)", len(silent),
                        self.client_timeout_s, len(closes))
            try:
                self._send(self.service.handle_many(closes))  # nobody reads these; the ROUTER drops them
            except Exception:  # noqa: BLE001 - as in _recv_all: a bug on one close must not end the engine
                log.exception("error closing the sessions of silent clients")
        return [msg.session_id for _, msg in closes]

    def run_once(self, timeout_ms: int | None = None) -> None:
        if timeout_ms is None:
            if self.service.engine.has_work():
                timeout_ms = 0
            else:  # only the codec worker (or held audio) is busy: wait a little instead of spinning on the GIL
                timeout_ms = WAIT_POLL_MS if self.service.has_work() else IDLE_POLL_MS
        if self._later or self.sock.poll(timeout_ms, zmq.POLLIN):
            t0 = time.perf_counter()
            with self.watch.section("message handling"):
                self._recv_all()
            self._load.handled(time.perf_counter() - t0)
        self.expire_silent_clients()
        if self.window is not None:
            self.window.poll(len(self.service.sessions))
        if self.service.has_work():
            t0 = time.perf_counter()
            try:
                with self.watch.section("engine step"):
                    outs = self.service.step()
            except Exception:
                log.exception("engine step failed; failing live responses and exiting")
                self._send(self._fail_all())
                raise
            self._send(outs)
            self._load.stepped(time.perf_counter() - t0)
            self._busy_since_check = True
            self._load.maybe_log()
        elif self._busy_since_check and time.monotonic() - self._last_check > INTEGRITY_EVERY_S:
            # Idle: verify the KV pool's books (free + used == total) once in a while.
            self._last_check, self._busy_since_check = time.monotonic(), False
            try:
                self.service.engine.check_integrity()
            except Exception:
                log.exception("KV integrity check failed; exiting so the supervisor restarts the engine")
                raise

    def _fail_all(self) -> list[Out]:
        outs: list[Out] = []
        for s in self.service.sessions.values():
            r = s.active.response if s.active is not None else None
            if r is not None:
                outs.append((s.owner, m.Error(s.session_id, errors.ENGINE_ERROR, "engine step failed", r.response_id)))
                outs.append((s.owner, m.ResponseDone(s.session_id, r.response_id, "failed",
                                                     reason=errors.ENGINE_ERROR)))
        return outs

    def serve_forever(self) -> None:
        while not self.stopping:
            self.run_once()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines.process.main", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.client_timeout_s <= 0:
        p.error(f"--client-timeout-s must be > 0, got {args.client_timeout_s}")
    window = None
    if args.gpu_window:
        from engines.process.observe.gpu_window import GpuWindow, WindowConfig

        try:
            window = GpuWindow(WindowConfig.parse(args.gpu_window))
        except ValueError as e:
            p.error(f"--gpu-window: {e}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s")
    from engines.config import ConfigError

    try:
        service = build_service(args)
    except (ConfigError, OSError) as e:
        log.error("cannot start the engine: %s", e)
        return 2
    server = EngineServer(service, args.endpoint, client_timeout_s=args.client_timeout_s, window=window)

    def stop(signum: int, _frame: Any) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # `kill -USR1 <engine pid>` writes every thread's stack to stderr from the signal handler itself, so it works
    # even when a thread is stuck in C code holding the GIL (where the stall watch cannot sample).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps({"pid": os.getpid(), "endpoint": args.endpoint,
                                                     "model": args.model, "codec": args.codec,
                                                     "device": args.device}))
    log.info("engine ready endpoint=%s", args.endpoint)
    try:
        server.serve_forever()
    except Exception:  # noqa: BLE001 - logged in run_once; the supervisor restarts us
        return 1
    finally:
        server.close()
    log.info("engine stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
