"""CodecDecoder: load the flow + a vocoder, open per-session streams, decode chunks of many sessions at once."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engines.config import KV_DTYPES, ConfigError, kv_torch_dtype, parse_dtype
from engines.cuda.memory import free_bytes
from engines.lm.step_graphs import SideStreams
from engines.speech_out.checkpoint import CheckpointError, load_checked, read_state_dict
from engines.speech_out.chunk_graphs import EncoderGraphs, EulerGraphs, VocoderGraphs
from engines.speech_out.codes import validate_codes
from engines.speech_out.config import CodecDecoderConfig
from engines.speech_out.flow.flow import FlowModel
from engines.speech_out.flow.full_context import FullContextFlow, FullVoice, first_job_codes, prompt_tails
from engines.speech_out.flow.full_graphs import FullEncoderGraphs, FullSolveGraphs
from engines.speech_out.flow.pages import DecoderCacheFull, EstimatorPages
from engines.speech_out.flow.reference import reference_mel
from engines.speech_out.flow.state import PreparedVoice
from engines.speech_out.mel_spec import MelSpec, check_same_mel
from engines.speech_out.presets import DECODER_PRESETS
from engines.speech_out.queued import QueuedRound, raise_full
from engines.speech_out.stream import DecodeStream, Job
from engines.speech_out.vocoder.vocoder import BigVGANVocoder, HiFTVocoder, Vocoder, WindowedVocoder
from engines.speech_out.voice import Voice
from engines.speech_out.voice_cache import VoiceCache

VOCODERS = ("bigvgan", "hift")
# How a stream's flow sees earlier chunks: "full", every earlier chunk and the prompt, as the chunk model was trained
# (full_context.py); "window", the prompt and the last few chunks only (flow.py: bounded state, an approximation).
CONTEXTS = ("full", "window")
# The full-context solve's graphs captured at load reach the default voice's pages and this much answer.
CAPTURE_ANSWER_S = 24
# The full-context decoder's cache when none is asked for, on a GPU: 936 pages, 32 answers' last 28 chunks and a
# voice's, but at most GPU_CACHE_SHARE of what the device has free as the decoder loads: the codec's CUDA graphs, the
# engine's headroom and the language model's KV pool come after. An H100 at the default --max-running (bf16 weights,
# 66 encoder slots) has ~43.6 GiB free there; 40 GiB left the engine no room to start; this share (458 pages) holds
# 16 sessions' answers and leaves a KV pool of 8.9 GiB, 28 sessions of SESSION_ROWS (server/limits.py), the codec's
# graphs holding 9.1 GiB (docs/bench/startup-h100-2026-12-06-defaults-largest-first.txt). The cache's sessions are
# the fewer, but at 16 the codec's rounds already hold p95 TTFA over 200 ms there (docs/performance.md, Capacity).
GPU_CACHE_GIB = 40.0
GPU_CACHE_SHARE = 0.45
CPU_CACHE_GIB = 0.5


def default_cache_gib(on_gpu: bool, free: int = 0) -> float:
    """The cache size CodecDecoder.load takes where none is given (free: the device's free bytes, on a GPU)."""
    return min(GPU_CACHE_GIB, GPU_CACHE_SHARE * free / 2**30) if on_gpu else CPU_CACHE_GIB


def build_modules(cfg: CodecDecoderConfig, with_bigvgan: bool) -> tuple[FlowModel, HiFTVocoder, Vocoder | None]:
    """Unloaded modules (weight norm not folded yet)."""
    return (FlowModel(cfg.flow, cfg.stream), HiFTVocoder(cfg.hift),
            BigVGANVocoder(cfg.bigvgan) if with_bigvgan else None)


def _bigvgan_mel(h: dict, source: str) -> MelSpec:
    try:
        return MelSpec(sample_rate=int(h["sampling_rate"]), n_mels=int(h["num_mels"]), hop=int(h["hop_size"]),
                       n_fft=int(h["n_fft"]), win=int(h["win_size"]), fmin=float(h["fmin"]),
                       fmax=float(h["fmax"]) if h.get("fmax") is not None else int(h["sampling_rate"]) / 2)
    except KeyError as e:
        raise ConfigError(f"{source}: missing mel field {e}") from None


@dataclass
class SolveCounts:
    """What `run_jobs` decoded since the last `take_counts` (the engine's load log): flow solves (one per chunk length
    in a call), of them for last chunks shorter than a full one, and their sessions against the rows the solve ran
    (with CUDA graphs: padded up to the graph's batch)."""

    solves: int = 0
    partial: int = 0
    rows: int = 0
    padded_rows: int = 0


def cache_page_bytes(cfg: CodecDecoderConfig, dtype: torch.dtype) -> int:
    """Bytes of one page of the full-context decoder's cache (a chunk's estimator keys and values) in `dtype`."""
    fc = cfg.flow
    return EstimatorPages.page_bytes(fc.n_timesteps, fc.est_n_blocks * (2 + fc.est_mid_blocks),
                                     cfg.stream.chunk_codes * fc.token_mel_ratio, fc.est_heads * fc.est_head_dim, dtype)


class CodecDecoder:
    """Flow + vocoder on one device. See engines/speech_out/__init__.py for the public API."""

    def __init__(self, cfg: CodecDecoderConfig, flow: FlowModel, vocoder: Vocoder, source: str,
                 default_voice: Voice) -> None:
        check_same_mel(cfg.flow.mel, vocoder.mel, vocoder.name)
        if flow.device.type == "cpu":
            # Mish/softplus on very negative inputs yields denormal floats, which are ~50x slower on x86 CPUs.
            # The engine process owns its threads, so flushing them process-wide is acceptable.
            torch.set_flush_denormal(True)
        self.cfg, self.flow, self.source = cfg, flow.eval(), source
        self.vocoder = vocoder.eval()
        self.windowed = WindowedVocoder(vocoder, cfg.stream)
        self.default_voice = default_voice
        self.counts = SolveCounts()
        self.full: FullContextFlow | None = None  # set by `load` for the full-context streaming decode
        self.voices = self._voice_cache()  # (made again by `load` once `full` is set)
        self.full_graphs: FullSolveGraphs | None = None  # its solve's CUDA graphs (this decoder's or lane's own)
        self.full_enc_graphs: FullEncoderGraphs | None = None  # its encoder's

    def _voice_cache(self) -> VoiceCache:
        return VoiceCache(self.full.prepare_voice if self.full is not None else self.flow.prepare_voice, self.full,
                          self.cfg.stream.max_prompt_codes, lambda: self.default_voice.name, self.device)

    @property
    def device(self) -> torch.device:
        return self.flow.device

    @property
    def sample_rate(self) -> int:
        return self.cfg.flow.mel.sample_rate

    @property
    def samples_per_code(self) -> int:
        return self.cfg.flow.token_mel_ratio * self.cfg.flow.mel.hop

    # ---- loading -----------------------------------------------------------------------------------------
    @classmethod
    def load(cls, codec: str | Path, device: str | torch.device = "cpu", vocoder: str = "bigvgan",
             seed: int = 0, cuda_graphs: bool = False, estimator_dtype: str = "float32",
             encoder_graphs: bool = True, encoder_tf32: bool = False, context: str = "full",
             cache_gib: float | None = None, cache_dtype: str = "auto", offline: bool = False) -> CodecDecoder:
        """codec: a preset name ("tiny-random", "full-random") or a codec directory (its layout: random_codec.py).
        cuda_graphs: replay the flow's Euler solve and the HiFT vocoder as CUDA graphs (CUDA devices only);
        encoder_graphs: with cuda_graphs, also the flow's encoder (EncoderGraphs, FullEncoderGraphs; False: eager).
        estimator_dtype: "bfloat16" runs the CFM estimator (the bulk of the FLOPs) in bf16; the ODE state,
        encoder and vocoder stay float32.
        context: how streams see earlier chunks (CONTEXTS); with "full", cache_gib sizes the estimator's key/value
        pages (default `default_cache_gib`: 40 GiB on a GPU or 45% of its free memory if less, 0.5 on a CPU;
        `EstimatorPages`), cache_dtype their element type: "auto" (the estimator's) or "fp8" (e4m3 saturated at
        +-448: half the bytes, so twice the pages in cache_gib and half the attention's reads; other numerics than the
        estimator's dtype: docs/fidelity.md).
        offline: the offline flow's weights (`flow/flow.pt`, for `decode`) instead of the chunk model's
        (`flow/flow-chunk-5.pt`, for streams).
        encoder_tf32: the flow encoder's float32 matmuls on TF32 tensor cores (CUDA; its convs already are, by
        torch's cuDNN default): PCM within ~1e-4 of float32, a batch-16 chunk ~1 ms shorter on an H100."""
        if context not in CONTEXTS:
            raise ConfigError(f"decoder context {context!r} not one of {CONTEXTS}")
        if cache_gib is not None and not cache_gib > 0:
            raise ConfigError(f"the decoder's cache must be > 0 GiB, got {cache_gib}")
        if cache_dtype not in KV_DTYPES:
            raise ConfigError(f"decoder cache dtype {cache_dtype!r} not one of {sorted(KV_DTYPES)}")
        dec = cls._load(codec, device, vocoder, seed, offline)
        dec.flow.encoder_tf32 = encoder_tf32
        dec.flow.decoder.estimator.to(parse_dtype(estimator_dtype))
        dec.flow.decoder.estimator.fuse()  # fused q/k/v weight in the final dtype (the checkpoint keeps q/k/v)
        dec.flow.encoder.fuse()
        if context == "full":
            dt = kv_torch_dtype(cache_dtype, estimator_dtype)
            if cache_gib is None:
                on_gpu = dec.device.type == "cuda"
                cache_gib = default_cache_gib(on_gpu, free_bytes(dec.device) if on_gpu else 0)
            dec.full = FullContextFlow(dec.flow, int(cache_gib * 2**30 // cache_page_bytes(dec.cfg, dt)),
                                       cache_dtype=dt)
            dec.voices = dec._voice_cache()
        if cuda_graphs and dec.device.type == "cuda":
            dec._attach_graphs(encoder_graphs)
        return dec

    def _attach_graphs(self, encoder_graphs: bool, urgent: bool = False) -> None:
        """Empty graph sets (captured on first use or by `capture_graphs`) for the Euler solve, the flow's encoder
        when `encoder_graphs`, and HiFT; `urgent`: captured (so replayed) at the most urgent priority."""
        if self.full is not None:
            self.full_graphs = FullSolveGraphs(self.full, urgent)
            if encoder_graphs:
                self.full_enc_graphs = FullEncoderGraphs(self.full, urgent)
        else:
            self.flow.graphs = EulerGraphs(self.flow, urgent)
        if encoder_graphs and self.full is None:
            self.flow.enc_graphs = EncoderGraphs(self.flow, urgent)
        if isinstance(self.vocoder, HiFTVocoder):
            st = self.cfg.stream
            self.vocoder.graphs = VocoderGraphs(self.vocoder.generator, st.voc_ctx_frames,
                                                st.chunk_codes * self.cfg.flow.token_mel_ratio, urgent)

    def lane(self) -> CodecDecoder:
        """Another decoder over the same weights, voices and streams' state, with CUDA graphs, graph memory and side
        streams of its own, so that its calls can run while this one's run (on another thread and CUDA stream): the
        codec worker decodes new answers' first chunks on a lane beside its rounds of playing answers. Graphs, when
        this decoder has them, are captured on first use or by `capture_graphs`, at the most urgent priority (a new
        answer's first audio waits on them; this decoder's own stay at the least)."""
        twin = copy.copy(self)
        twin.counts = SolveCounts()
        twin.flow = copy.copy(self.flow)  # shares the modules; plain attributes (graphs, streams) become its own
        twin.flow._chain_streams = SideStreams()
        twin.vocoder = copy.copy(self.vocoder)
        twin.vocoder._modules = dict(self.vocoder._modules)  # so that a new generator does not replace ours
        gen = getattr(self.vocoder, "generator", None)
        if gen is not None and hasattr(gen, "_branch_streams"):
            twin.vocoder.generator = copy.copy(gen)
            twin.vocoder.generator._branch_streams = SideStreams()
        twin.windowed = WindowedVocoder(twin.vocoder, self.cfg.stream)
        if self.flow.graphs is not None or self.full_graphs is not None:
            twin._attach_graphs(self.flow.enc_graphs is not None or self.full_enc_graphs is not None, urgent=True)
        return twin

    def take_counts(self) -> SolveCounts:
        """The counts since the last call (a round that runs meanwhile may land in either)."""
        c, self.counts = self.counts, SolveCounts()
        return c

    def capture_graphs(self, max_batch: int, partial_chunks: bool = True, first_jobs: bool = True) -> int:
        """With CUDA graphs on, capture the graphs (encoder, Euler solve, HiFT vocoder) of full chunks and, with
        `partial_chunks`, of every shorter last chunk (1..chunk-1 codes: one per answer; the encoder runs those
        eagerly), for every batch bucket up to `max_batch` sessions now (seconds), instead of on first use inside an
        answer (a capture of the full-size solve stalls the codec worker 0.8-1.6 s on an H200). With full context
        and `first_jobs`, also every voice's first job (its solve, and the vocoder over its answer codes: both depend
        only on the prompt's tail) and its encoder. In half precision the solve's graphs serve answers of any length; a
        float32 estimator's are captured for the default voice's and 24 s of answer (`FullContextFlow.graph_pages`).
        The full-context encoder's serve any voice and length. The windowed flow's encoder graphs depend on the prompt's
        length: those of the default voice are captured (other voices capture theirs on first use). `first_jobs` False:
        a decoder whose first jobs run on lanes of their own.
        Returns graphs captured (0 without CUDA graphs)."""
        st, r = self.cfg.stream, self.cfg.flow.token_mel_ratio
        codes = list(range(1, st.chunk_codes + 1) if partial_chunks else (st.chunk_codes,))
        n = 0
        if self.full_graphs is not None:
            fc = self.cfg.flow
            frames_s = fc.mel.sample_rate / fc.mel.hop
            answer = int(CAPTURE_ANSWER_S * frames_s) // self.full.page_frames
            voice = self.prepared(self.default_voice)
            # Every voice's first job: its tail, then answer codes up to a chunk boundary (the vocoder renders those).
            firsts = {(first_job_codes(t, st.chunk_codes), t) for t in prompt_tails(st.chunk_codes, fc.pre_lookahead)}
            n += self.full_graphs.capture_steady_state(
                max_batch, len(voice.pages) + answer,
                sorted({(j // st.chunk_codes, len(voice.pages)) for j, _ in firsts}) if first_jobs else ())
            if self.full_enc_graphs is not None:
                n += self.full_enc_graphs.capture_steady_state(
                    max_batch, sorted({j for j, _ in firsts}) if first_jobs else ())
            if first_jobs:
                codes = sorted(set(codes) | {j - t for j, t in firsts})
        if self.flow.enc_graphs is not None:
            n += self.flow.enc_graphs.capture_steady_state(max_batch, self.prepared(self.default_voice).n_codes)
        for g in (self.flow.graphs, getattr(self.vocoder, "graphs", None)):
            if g is not None:
                n += g.capture_steady_state(max_batch, [c * r for c in codes])
        return n

    @classmethod
    def _load(cls, codec: str | Path, device: str | torch.device, vocoder: str, seed: int, offline: bool
              ) -> CodecDecoder:
        if vocoder not in VOCODERS:
            raise ConfigError(f"vocoder {vocoder!r} not one of {VOCODERS}")
        device = torch.device(device)
        if str(codec) in DECODER_PRESETS:
            cfg = DECODER_PRESETS[str(codec)]
            torch.manual_seed(seed)
            flow, hift, big = build_modules(cfg, with_bigvgan=vocoder == "bigvgan")
            voc = big if vocoder == "bigvgan" else hift
            voc.fold_weight_norm()
            voice = Voice.random(seed=1234, n_mels=cfg.flow.output_size, spk_dim=cfg.flow.spk_embed_dim)
            return cls(cfg, flow.to(device), voc.to(device), f"preset {codec} (random weights)", voice)
        root = Path(codec)
        if not root.is_dir():
            raise ConfigError(f"codec {codec!r} is neither a preset nor a directory")
        cfg_file = root / "flow" / "decoder.json"
        cfg = CodecDecoderConfig.from_json(cfg_file) if cfg_file.is_file() else CodecDecoderConfig()
        flow_file = root / "flow" / ("flow.pt" if offline else "flow-chunk-5.pt")
        if vocoder == "bigvgan":
            hp_file = root / "bigvgan" / "config.json"
            if not hp_file.is_file():
                raise ConfigError(f"{root}: no BigVGAN vocoder (bigvgan/config.json) trained on the codec mel; "
                                  f"use vocoder='hift' for the public codec")
            try:
                h = json.loads(hp_file.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{hp_file}: invalid JSON ({e})") from None
            check_same_mel(cfg.flow.mel, _bigvgan_mel(h, str(hp_file)), f"bigvgan ({hp_file})")
        flow, hift, big = build_modules(cfg, with_bigvgan=vocoder == "bigvgan")
        load_checked(flow, read_state_dict(flow_file), str(flow_file))
        if vocoder == "hift":
            hift_file = root / "flow" / "hift.pt"
            load_checked(hift.generator, read_state_dict(hift_file), str(hift_file), strip_prefix="generator.",
                         weight_norm_aliases=True)
            hift.fold_weight_norm()
            voc: Vocoder = hift
        else:
            gen_file = root / "bigvgan" / "bigvgan_generator.pt"
            if not gen_file.is_file():
                raise CheckpointError(f"codec checkpoint {gen_file} does not exist")
            raw = torch.load(gen_file, map_location="cpu", weights_only=True)
            sd = raw.get("generator", raw) if isinstance(raw, dict) else raw
            load_checked(big.generator, sd, str(gen_file))
            big.fold_weight_norm()
            voc = big
        default_voice = Voice.empty(cfg.flow.output_size, cfg.flow.spk_embed_dim)
        return cls(cfg, flow.to(device), voc.to(device), str(root), default_voice)

    # ---- sessions ----------------------------------------------------------------------------------------
    def prepared(self, voice: Voice) -> PreparedVoice | FullVoice:
        """The flow's form of `voice` (`VoiceCache.get`)."""
        return self.voices.get(voice)

    def warm_voice(self, voice: Voice) -> None:
        """Make the flow's form of `voice` on the calling thread, off the engine loop (`VoiceCache.warm`)."""
        self.voices.warm(voice)

    def check_idle_cache(self) -> None:
        """Invariant, with no stream open: every page of the full-context cache is free or a cached voice's."""
        self.voices.check_idle()

    def open_stream(self, session_id: str, voice: Voice | None = None, seed: int = 0) -> DecodeStream:
        voice = voice or self.default_voice
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        pv, fs = self.voices.holding(voice, lambda pv: self.full.new_state(pv) if self.full is not None
                                     else self.flow.new_state(pv, gen))
        vs = self.windowed.new_state(pv.mel, gen)
        ready = None
        if self.device.type == "cuda":  # the state may be decoded on another thread's stream: see DecodeStream.adopt
            ready = torch.cuda.Event()
            ready.record()
        # Full context: the prompt's tail codes go first, so that the answer's chunks fall where the reference's do.
        tail = list(pv.tail) if self.full is not None else []
        return DecodeStream(self, session_id, fs, vs, gen, pending=tail, ready=ready, prompt_left=len(tail))

    def stream_all(self, codes, voice: Voice | None = None, seed: int = 0) -> np.ndarray:
        """The streaming decode of all `codes` at once (the same chunks as a stream fed code by code)."""
        s = self.open_stream("offline", voice, seed)
        try:
            s.add(codes)
            return np.concatenate([s._run(s.take_jobs()), s.finalize()])
        finally:
            s.close()

    @torch.inference_mode()
    def decode(self, codes, voice: Voice | None = None, seed: int = 0) -> np.ndarray:
        """Offline decode, the offline flow's semantics (load with offline=True for its weights): one call with full
        attention over the prompt and every code, then the vocoder over the whole answer."""
        codes = torch.as_tensor(validate_codes(codes), dtype=torch.long)
        if codes.numel() == 0:
            return np.zeros(0, np.float32)
        voice = voice or self.default_voice
        if voice.codes.shape[0] > self.cfg.stream.max_prompt_codes:
            raise ConfigError(f"voice {voice.name}: prompt of {voice.codes.shape[0]} codes exceeds "
                              f"{self.cfg.stream.max_prompt_codes}")
        f, dev = self.flow, self.device
        gen = torch.Generator(device=dev).manual_seed(int(seed))
        frames = (voice.codes.shape[0] + codes.shape[0]) * self.cfg.flow.token_mel_ratio
        z = torch.randn(self.cfg.flow.output_size, frames, generator=gen, device=dev, dtype=f.dtype)
        mel = reference_mel(f, voice.codes, voice.mel, f.speaker(voice.xvector), codes, z, chunk=False)
        vs = self.windowed.new_state(voice.mel.to(dev, f.dtype), gen)
        return self.windowed.finish(self.windowed.render(mel[None], [vs], [gen]), [vs], [True])[0]

    # ---- batched chunk decoding --------------------------------------------------------------------------
    @torch.inference_mode()
    def run_jobs(self, jobs: list[Job], between: Callable[[], None] | None = None
                 ) -> list[np.ndarray | DecoderCacheFull]:
        """Decode jobs of distinct sessions together (grouped by chunk length). Returns PCM per job, in order, or for
        a job whose chunks found no page in the full-context decoder's cache, that error (its answer cannot go on; the
        others are decoded). `between` is called each time a piece of the GPU work is queued (the flow's encoder, each
        piece of its solve: FlowModel.solve_parts), on this thread: the caller may wait there, e.g. to give the GPU to
        more urgent work before queueing the rest (the vocoder follows the last piece)."""
        queued = self.queue_jobs(jobs, between)
        pcm = queued.collect()
        self.last_gpu_wait_s = queued.gpu_wait_s  # (load logs: how much of a call was the GPU's)
        return pcm

    @torch.inference_mode()
    def queue_jobs(self, jobs: list[Job], between: Callable[[], None] | None = None) -> QueuedRound:
        """`run_jobs`' work queued on the current stream; its results from the round's `collect()` (queued.py)."""
        if len({id(j.stream) for j in jobs}) != len(jobs):
            raise ValueError("run_jobs takes at most one chunk per session (chunks of a session are sequential)")
        queued = QueuedRound(list(jobs), [None] * len(jobs), self.windowed)
        live = list(range(len(jobs)))
        if self.full is not None:
            # Each job's pages are taken here, as its round starts, not when its codes came: the language model runs
            # seconds ahead of the audio, and pages held that far ahead would be pages nobody reads yet.
            for i, j in enumerate(jobs):
                try:
                    self.full.reserve(j.stream.flow_state,
                                      self.full.pages_for(len(j.codes), self.cfg.stream.chunk_codes))
                except DecoderCacheFull as e:
                    queued.results[i] = e
            live = [i for i, o in enumerate(queued.results) if o is None]
        if live:
            self._queue_jobs(queued, live, between)
        queued.mark_queued(self.device)
        return queued

    def run_jobs_or_raise(self, jobs: list[Job]) -> list[np.ndarray]:
        """`run_jobs` for callers that stop at any failure (a stream decoded on its own, a bench's rounds): a job's
        DecoderCacheFull is raised."""
        return raise_full(self.run_jobs(jobs))

    def _queue_jobs(self, queued: QueuedRound, live: list[int], between: Callable[[], None] | None) -> None:
        """The flow and the vocoder of queued.jobs[i] for i in `live`, queued; their windows in `queued.rendered`."""
        jobs = [queued.jobs[i] for i in live]
        for j in jobs:
            j.stream.adopt()
        groups: dict[int, list[int]] = {}
        for i, j in zip(live, jobs, strict=True):
            groups.setdefault(len(j.codes), []).append(i)
        # Sessions of one voice and window length side by side: the flow copies their keys as one run (FlowModel._runs).
        # Rows are independent, so the order changes no result.
        for idx in groups.values():
            idx.sort(key=lambda i: queued.jobs[i].stream.flow_state.run_key())
        la = self.cfg.flow.pre_lookahead
        for n, idx in groups.items():
            js = [queued.jobs[i] for i in idx]
            if n == 0:  # tail flush only: the tail an earlier round leaves, taken when this round is collected
                queued.flushes.extend(idx)
                continue
            rows = [j.codes + j.look + [0] * (la - len(j.look)) for j in js]
            codes = torch.from_numpy(np.array(rows, dtype=np.int64))  # (numpy: ~3x faster than torch.tensor here)
            gens = [j.stream.gen for j in js]
            states = [j.stream.flow_state for j in js]
            if self.full is not None:
                mel = self.full.decode_chunk(states, codes, n, [len(j.look) for j in js], gens, self.full_graphs,
                                             self.full_enc_graphs)
            else:
                mel = self.flow.decode_chunk(states, codes, n, [len(j.look) for j in js], gens, between)
            c = self.counts
            c.solves += 1
            c.partial += n < self.cfg.stream.chunk_codes
            c.rows += len(js)
            # (the solve's graphs exist only on CUDA, where every solve replays them)
            c.padded_rows += self.flow.graphs.last_batch if self.flow.graphs is not None else len(js)
            # A chunk that starts with the prompt's tail (full context) renders only its answer frames.
            skips: dict[int, list[int]] = {}
            for k, st in enumerate(states):
                skips.setdefault(getattr(st, "skip", 0), []).append(k)
            for skip, ks in skips.items():
                sub = [idx[k] for k in ks]
                if skip == mel.shape[2]:  # the prompt's alone (an answer without codes): no audio
                    for i in sub:
                        queued.results[i] = np.zeros(0, np.float32)
                    continue
                sel = mel if len(ks) == len(js) else mel[ks]
                queued.rendered.append((sub, [js[k] for k in ks], self.windowed.render(
                    sel[:, :, skip:], [js[k].stream.voc_state for k in ks], [gens[k] for k in ks])))
