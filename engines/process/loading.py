"""Building the engine process's Service from its ProcessConfig: the language model, the speech encoder and the codec
decoder loaded (with their KV slots and CUDA graphs on a GPU), the tokenizer, the voice prompts' loader, and the
warm-up turns."""

from __future__ import annotations

import gc
import hashlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines.config import PRESETS, ConfigError, EngineConfig
from engines.cuda.memory import free_bytes
from engines.cuda.streams import model_stream
from engines.lm.engine import Engine
from engines.lm.kv.sizing import GIB, thin_pool_warning
from engines.process.codec_pacing import FIRST_MAX, PLAYING_SOLVE_PARTS
from engines.process.config import ProcessConfig
from engines.process.observe.startup_memory import StartupMemory
from engines.process.service import Service
from engines.process.tokenizer import load_tokenizer
from engines.process.warm_up import warm_up
from engines.speech_in import SpeechEncoder
from engines.speech_out.chunk_graphs import BucketGraphs
from engines.speech_out.decoder import CodecDecoder
from engines.speech_out.presets import served_options
from engines.speech_out.voice import DEFAULT_VOICE_WAV, Voice
from engines.weights_check import model_notes, require_weights

log = logging.getLogger("engines.process")
# Speech-encoder slots only segment-floor re-encodes take (engines/speech_in/slot_pool.py): a re-encode holds one per
# 30 s segment for one encoder call, and turns that do not fit at once go one after another (encoder_worker.py).
REENCODE_SLOTS = 2


def _load_codec(config: ProcessConfig, engine_config: EngineConfig, memory: StartupMemory) -> tuple[Any, Any, Any]:
    """The speech encoder, the codec decoder and its first-chunk lanes (none off a GPU or without --first-lane),
    with their KV slots and CUDA graphs on a GPU."""
    on_gpu = config.on_gpu
    first_decoders = []
    served = served_options(config.codec, on_gpu, config.vocoder)
    with memory.part("the speech encoder"):
        encoder = SpeechEncoder.load(config.codec, device=config.device, tf32=config.encoder_tf32)
    if on_gpu:
        # KV slots for every sequence the engine runs: growing the pool under load (it doubles) stalls the
        # engine loop for the allocation and copy. And a few for the segment-floor re-encodes alone: with every
        # sequence's slot in use, a turn answered early (its stream still open) would find none.
        n = engine_config.max_running
        with memory.part(f"the speech encoder's KV slots for {n} streams and {REENCODE_SLOTS} re-encodes "
                         f"({encoder.runner.kv.slot_bytes() / 2**20:.0f} MiB each)"):
            encoder.reserve(n, reencodes=REENCODE_SLOTS)
        if config.encoder_graphs:  # after the reserve: a growth of the KV pool retires them
            with memory.part("the speech encoder's CUDA graphs"):
                encoder.capture_graphs()
    cache = " and its cache of earlier chunks (--decoder-cache-gib)" if config.decoder_context == "full" else ""
    with memory.part(f"the codec decoder{cache}"):
        decoder = CodecDecoder.load(config.codec, device=config.device, seed=config.seed,
                                    context=config.decoder_context, cache_gib=config.decoder_cache_gib,
                                    cache_dtype=config.decoder_cache_dtype, **served)
    # First: the graphs captured below are those of the default voice's prompt length.
    with memory.part("the default voice"):
        decoder.default_voice = default_voice(encoder, config)
    first_lane = config.first_lane
    if first_lane:  # rounds of playing answers yield between the pieces of their solve (codec_pacing)
        decoder.flow.solve_parts = PLAYING_SOLVE_PARTS
    with memory.part(f"the codec's CUDA graphs for batches of up to {engine_config.max_running}"):
        # Every running sequence may be a speaking session in one codec batch: capture those graphs now. With lanes,
        # answers' first jobs run only there (codec_worker.py): this decoder needs none of their graphs.
        lanes = config.first_lanes if first_lane else 0
        graphs = decoder.capture_graphs(engine_config.max_running, first_jobs=not lanes)
        for _ in range(lanes):
            lane = decoder.lane()
            lane.flow.solve_parts = 1  # first chunks never yield: one graph per solve
            graphs += lane.capture_graphs(FIRST_MAX)
            first_decoders.append(lane)
        log.info("start-up: %d codec graphs captured (%d first-chunk lanes)", graphs, len(first_decoders))
    return encoder, decoder, first_decoders


def build_service(config: ProcessConfig) -> Service:
    """The Service the engine process serves, everything loaded (and warmed up with --warm-up)."""
    engine_config = config.engine_config()
    on_gpu = config.on_gpu
    if on_gpu:
        # The language model's steps run on a high-priority stream, so they never queue behind the codec
        # worker's rounds of playing answers (lowest priority) for SMs: a decode step is a few ms of GPU work
        # that every session waits for. (The speech encoder's commits and the first-chunk lanes have streams one
        # level above it: engines.cuda.streams.model_stream.)
        torch.cuda.set_stream(model_stream(config.device))
    # The codec and encoder worker threads run Python between their GPU waits; a short switch interval keeps the
    # engine loop from waiting up to 5 ms (the default) for the GIL after each of its own waits.
    sys.setswitchinterval(0.0005)
    t0 = time.monotonic()
    # Every file, key, shape and dtype before anything loads: a bad download is refused whole, by name.
    require_weights(config.model, config.codec)
    for note in model_notes(config.model) if config.model not in PRESETS else []:
        log.warning("%s", note)
    memory = StartupMemory(config.device)
    # The model's KV pool last: with --kv-cache-gib auto it takes what the device has left after the weights and the
    # codec. (The weights first: building random ones takes more than they keep.)
    with memory.part("the language model's weights"):
        model, model_config = Engine.load_weights(config.model, engine_config, seed=config.seed)
    encoder, decoder, first_decoders = (_load_codec(config, engine_config, memory) if config.codec != "none"
                                        else (None, None, []))
    with memory.part("the language model's KV pool and CUDA graphs"):
        engine = Engine.build(model, model_config, engine_config, seed=config.seed,
                              kv_free_bytes=free_bytes(config.device) if config.kv_auto else None)
    del model
    if config.kv_auto:
        log.info("KV pool: %.1f GiB (auto: the GPU's free memory less a headroom)",
                 engine.config.kv_cache_bytes / GIB)
    thin = thin_pool_warning(engine.config.kv_cache_bytes, engine.config, model_config)
    if thin:
        log.warning("%s", thin)
    tokenizer = load_tokenizer(config.model)
    voices = voice_loader(encoder, config.codec, decoder) if encoder is not None else None
    if config.model in ("tiny-random", "full-random") or config.codec in ("tiny-random", "full-random"):
        log.warning("random weights (model=%s codec=%s): answers are noise", config.model, config.codec)
    log.info("loaded model=%s codec=%s device=%s dtype=%s in %.1f s", config.model, config.codec, config.device,
             engine_config.dtype, time.monotonic() - t0)
    service = Service(engine, tokenizer, encoder, decoder, voices,
                      encode_every_s=config.encode_every_ms / 1000,
                      first_decoders=first_decoders, codec_round_max=config.codec_round_max,
                      codec_round_period_s=config.codec_round_period_ms / 1000,
                      encoder_thread=config.encoder_thread, limits=config.input_limits())
    if config.warm_up and encoder is not None and decoder is not None:
        t1 = time.monotonic()
        with memory.part("the warm-up turns"):
            warm_up(service)
        log.info("warm-up turns in %.1f s", time.monotonic() - t1)
    # Everything loaded so far lives as long as the process: keep it out of every later collection's scan.
    gc.collect()
    gc.freeze()
    BucketGraphs.warn_captures = True
    return service


def default_voice(encoder: Any, config: ProcessConfig) -> Voice:
    """The voice of sessions that set none: --voice's recording, else the bundled one (DEFAULT_VOICE_WAV)."""
    path = Path(config.voice) if config.voice is not None else DEFAULT_VOICE_WAV
    try:
        return voice_loader(encoder, config.codec)(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--voice {path}: {e}") from None


def voice_loader(encoder: Any, codec: str, decoder: Any = None) -> Callable[[bytes], Any]:
    """WAV bytes -> a decoder Voice: codes by our speech encoder (in pieces, on its lowest-priority stream), x-vector
    by the codec's campplus.onnx when the codec directory has it (random presets: zero x-vector), and with `decoder`
    its flow's form made too (`CodecDecoder.warm_voice`: the voice worker's thread, not the loop, pays for it). A
    recording it cannot use raises ValueError saying why. Named by content, so the decoder's voice cache serves
    sessions that send the same recording."""
    campplus = Path(codec) / "flow" / "campplus.onnx"
    campplus_path = campplus if campplus.is_file() else None

    def load(wav: bytes) -> Any:
        name = f"wav-{hashlib.sha1(wav).hexdigest()[:16]}"
        try:
            voice = Voice.from_wav(wav, encode=encoder.encode_in_pieces, campplus=campplus_path, name=name)
        except ValueError as e:
            raise ValueError(f"voice_wav is not a usable recording: {e}") from None
        if decoder is not None:
            decoder.warm_voice(voice)
        return voice

    return load
