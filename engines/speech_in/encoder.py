"""SpeechEncoder (weights + batched runner), EncoderStream (one session), EncoderBatch (many at once)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engines.config import parse_dtype
from engines.cuda.precision import float32_matmuls
from engines.cuda.streams import driver_stream, high_priority_stream, wait_releasing_gil
from engines.speech_in.config import EncoderConfig
from engines.speech_in.log_mel import MelFrontend, MelState
from engines.speech_in.model import StreamingRunner, WhisperVQTrunk
from engines.speech_in.presets import ENCODER_PRESETS
from engines.speech_in.segment_floor import Refloor, RefloorJob, refloor, refloor_many, segments_done
from engines.speech_in.step_graphs import StepGraphs
from engines.speech_in.step_plan import TrunkState
from engines.speech_in.weights import PREFIX, load_state, random_state


class EncoderInputError(ValueError):
    """PCM handed to the encoder is not a finite 1-D float signal."""


class StreamClosedError(RuntimeError):
    """push()/finalize() on a stream that was already finalized."""


def _as_pcm(pcm: np.ndarray | torch.Tensor) -> np.ndarray:
    """Checked float32 samples on the host (the frontend frames them there)."""
    if isinstance(pcm, torch.Tensor):
        pcm = pcm.detach().cpu().numpy()
    if not isinstance(pcm, np.ndarray):
        raise EncoderInputError(f"PCM must be a numpy array or tensor, got {type(pcm).__name__}")
    if pcm.ndim != 1:
        raise EncoderInputError(f"PCM must be 1-D mono samples, got shape {tuple(pcm.shape)}")
    if not np.issubdtype(pcm.dtype, np.floating):
        raise EncoderInputError(f"PCM must be float samples in [-1, 1], got dtype {pcm.dtype}")
    pcm = np.ascontiguousarray(pcm, dtype=np.float32)
    if pcm.size and not np.isfinite(pcm).all():
        raise EncoderInputError("PCM contains NaN or infinite samples")
    return pcm


class SpeechEncoder:
    """Causal Whisper-VQ speech encoder: 16 kHz PCM -> 12.5 Hz codes in [0, codebook_size)."""

    def __init__(self, cfg: EncoderConfig, state: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, tf32: bool = False) -> None:
        if tf32 and (device.type != "cuda" or dtype != torch.float32):
            raise ValueError(f"the speech encoder on TF32 needs float32 on a CUDA device, got {dtype} on {device}")
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        with torch.device("meta"):  # no throwaway random init of ~340M parameters at full size
            trunk = WhisperVQTrunk(cfg)
        trunk.load_state_dict(state, strict=True, assign=True)
        self.trunk = trunk.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.frontend = MelFrontend(cfg, device)
        self.runner = StreamingRunner(self.trunk, self.frontend, dtype, device, tf32)
        # Its own CUDA streams: the codes are read back at once (a host sync), which on the language model's
        # stream would also wait for the decode steps queued there.
        # High priority: a commit's last codes are on every answer's path to first audio. Audio still being spoken
        # (`batch(urgent=False)`) goes on a stream of the lowest priority: under load those calls are the big ones
        # (float32, ~50 ms for 100 sessions on an H200), and their kernels should leave SMs to the decode steps.
        # Each call ends with a wait for its stream, so the streams never hold each other's tensors in flight.
        self.stream = high_priority_stream(device) if device.type == "cuda" else None
        self.bulk_stream = driver_stream(device) if device.type == "cuda" else None
        # The KV pool's slots (opening, release, growth) and the graphs' capture take turns under `lock`. Calls
        # run in two lanes (`_lane`): one urgent call (a commit's) may run while one of held audio or a piece of a
        # voice prompt does, so a commit need not wait for a held call of every speaking session. A call touches only
        # its own streams' rows of the pool (padding writes go to the spare), and the lanes never replay the same
        # graphs at once; a growth of the pool, which moves every row, waits until no call is in flight.
        self.lock = threading.RLock()
        self._lanes = threading.Condition()
        self._busy: set[str] = set()  # lanes with a call in flight
        self._growing = 0  # threads waiting to grow the pool: no call starts until they have
        self._quiet = False  # the pool grows: no call is in flight or starts
        self._calls = threading.local()  # per thread: a voice prompt's call must not overwrite the worker's figure

    @property
    def last_gpu_wait_s(self) -> float:
        """How long the calling thread's last encoder call waited for the GPU (the service's load log)."""
        return getattr(self._calls, "gpu_wait_s", 0.0)

    @last_gpu_wait_s.setter
    def last_gpu_wait_s(self, seconds: float) -> None:
        self._calls.gpu_wait_s = seconds

    @classmethod
    def load(cls, path_or_preset: str | Path, device: str | torch.device = "cpu",
             dtype: str | torch.dtype | None = None, seed: int = 0, tf32: bool = False) -> SpeechEncoder:
        """A preset name (random weights, seeded) or a codec directory (config.json + model.safetensors); `tf32`:
        float32 products on TF32 (StreamingRunner.tf32)."""
        dev = torch.device(device)
        name = str(path_or_preset)
        if name in ENCODER_PRESETS:
            cfg = ENCODER_PRESETS[name]
            tdtype = parse_dtype(dtype or cfg.torch_dtype)
            full = random_state(cfg, seed=seed, device=dev, dtype=tdtype)
            state = {k[len(PREFIX):]: v for k, v in full.items() if k[len(PREFIX):] in _trunk_names(cfg)}
        else:
            cfg = EncoderConfig.from_dir(path_or_preset)
            tdtype = parse_dtype(dtype or cfg.torch_dtype)
            state = load_state(path_or_preset, cfg, dev)
        return cls(cfg, state, dev, tdtype, tf32)

    def reserve(self, streams: int, reencodes: int = 0) -> None:
        """Preallocate KV slots for this many concurrent streams (else the pool doubles as needed), and `reencodes`
        more that only re-encodes take (slot_pool.py)."""
        with self._no_calls(), self.lock, self._on_stream():
            self.runner.kv.reserve(streams, held_back=reencodes)

    def new_state(self, reencode: bool = False) -> TrunkState:
        """A new stream's state holding a KV slot; a growth of the pool first waits for the calls in flight."""
        with self.lock:
            if self.runner.kv.has_free(reencode):
                return self.runner.new_state(reencode)
        with self._no_calls(), self.lock:
            return self.runner.new_state(reencode)

    @contextlib.contextmanager
    def _no_calls(self) -> Iterator[None]:
        """No encoder call in flight until the block ends (they finish first; new ones wait)."""
        with self._lanes:
            self._growing += 1
            self._lanes.wait_for(lambda: not self._quiet and not self._busy)
            self._growing -= 1
            self._quiet = True
        try:
            yield
        finally:
            with self._lanes:
                self._quiet = False
                self._lanes.notify_all()

    def _lane_of(self, urgent: bool, streams: int) -> str:
        """"urgent", or "held" for held audio's steps that cannot replay the urgent graphs (one that can takes the
        urgent lane: one replay of a graph at a time). Read under `_lanes` with no growth or capture going on."""
        graphs = self.runner.graphs
        return "urgent" if urgent or (graphs is not None and graphs.may_replay(streams)) else "held"

    @contextlib.contextmanager
    def _lane(self, urgent: bool, streams: int) -> Iterator[None]:
        """A call of `streams` streams in its lane (`_lane_of`), chosen once no growth or capture can change it."""
        with self._lanes:
            self._lanes.wait_for(lambda: not (self._quiet or self._growing)
                                 and self._lane_of(urgent, streams) not in self._busy)
            lane = self._lane_of(urgent, streams)
            self._busy.add(lane)
        try:
            yield
        finally:
            with self._lanes:
                self._busy.discard(lane)
                self._lanes.notify_all()

    def capture_graphs(self, max_batch: int = 8) -> int:
        """CUDA graphs of the blocks for steps of up to `max_batch` streams (StepGraphs), then the kernels that
        bigger (eager) steps use compiled; reserve the KV pool first (a growth retires the graphs). Returns how many
        graphs were captured."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        with self._no_calls(), self.lock, self._on_stream(), float32_matmuls(self.runner.tf32):
            graphs = StepGraphs(self.runner, max_batch)
            n = graphs.capture()
            self.runner.graphs = graphs
            self.runner.warm_kernels()
        return n

    def release_slot(self, state: TrunkState) -> None:
        with self.lock:
            self.runner.release(state)

    def _on_stream(self, urgent: bool = True) -> contextlib.AbstractContextManager:
        """Encoder work and the state it keeps go on the encoder's stream (when it has one)."""
        stream = self.stream if urgent else self.bulk_stream
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def open_stream(self, reencode: bool = False) -> EncoderStream:
        """A stream (`reencode`: one of a segment-floor re-encode, which may take a held-back slot)."""
        return EncoderStream(self, reencode)

    def batch(self, urgent: bool = True) -> EncoderBatch:
        """Several streams in one call; `urgent=False`: on the lowest-priority stream (audio still being spoken)."""
        return EncoderBatch(self, urgent)

    def encode(self, pcm: np.ndarray | torch.Tensor) -> list[int]:
        """Whole-utterance encode: one forward over all frames, tail padded as in `finalize()`."""
        s = self.open_stream()
        return s.push(pcm) + s.finalize()

    def encode_in_pieces(self, pcm: np.ndarray | torch.Tensor, piece_samples: int = 16000) -> list[int]:
        """`encode`'s codes, made in calls of `piece_samples` each on the lowest-priority stream (a voice prompt, off
        the engine loop): between two pieces the service's calls of user audio and commits take their turn, so none
        waits for a whole prompt's forward."""
        x = _as_pcm(pcm)
        s = self.open_stream()
        batch = self.batch(urgent=False)
        try:
            codes: list[int] = []
            for i in range(0, len(x), piece_samples):
                codes += batch.step([(s, x[i:i + piece_samples])])[0]
            return codes + batch.finalize([s])[0]
        finally:
            s.close()

    def codes_for_samples(self, n_samples: int) -> int:
        """Codes a finalized stream of n samples yields: one per started 80 ms."""
        return -(-n_samples // self.cfg.samples_per_code)

    def tail_padding(self, n_samples: int) -> int:
        """Zeros `finalize` adds after n samples: for the last started code to be determined."""
        total = self.codes_for_samples(n_samples)
        if total == 0:
            return 0
        return max(0, self.cfg.samples_per_code * (total - 1) + self.cfg.code_lag_samples - n_samples)

    def refloor(self, pcm: np.ndarray, final: bool, first_segment: int = 0, end_segment: int | None = None,
                urgent: bool = True) -> Refloor | None:
        """A turn's codes with Whisper's whole-segment log-mel floor, of its segments from `first_segment` up to
        `end_segment` (segment_floor.py); None: its codes there stand."""
        with self._on_stream(urgent):
            return refloor(self, _as_pcm(pcm), final, first_segment, end_segment, urgent)

    def refloor_many(self, jobs: list[RefloorJob], urgent: bool = True) -> list[Refloor | None]:
        """`refloor` of several turns in one batched encoder call (segment_floor.py). All of it on the call's
        stream, the frame maxima it waits for included (on a calling thread's own current stream, the default one, they
        would run at the least priority, the codec rounds' own, and a commit's re-encode waits for them)."""
        with self._on_stream(urgent):
            return refloor_many(self, [dataclasses.replace(j, pcm=_as_pcm(j.pcm)) for j in jobs], urgent)

    def stream_peaks(self, streams: list[EncoderStream]) -> np.ndarray:
        """[streams] each stream's running log-mel max so far (-inf before its first frame), read after the steps
        queued on the encoder's lowest-priority CUDA stream (where held audio's steps run)."""
        out = np.full(len(streams), -np.inf)
        stepped = [i for i, s in enumerate(streams) if s.mel.frames_done]
        if stepped:
            with self._on_stream(False):
                slots = torch.tensor([streams[i].trunk.slot for i in stepped], device=self.device)
                out[stepped] = self.runner.kv.peaks[slots].cpu().numpy()
        return out

    def segments_done(self, n_samples: int) -> int:
        """The 30 s segments whose floor is final once a stream has n samples (segment_floor.py)."""
        return segments_done(self, n_samples)


_TRUNK_NAMES: dict[EncoderConfig, set[str]] = {}


def _trunk_names(cfg: EncoderConfig) -> set[str]:
    if cfg not in _TRUNK_NAMES:
        _TRUNK_NAMES[cfg] = set(WhisperVQTrunk(cfg).to("meta").state_dict())
    return _TRUNK_NAMES[cfg]


class EncoderStream:
    """One session's encoder state. Codes come out as soon as they are determined.

    Code k covers the 80 ms of samples [1280 k, 1280 k + 1280); it is determined once sample
    1280 k + 1160 has arrived (the centred 25 ms mel window of the group's last 50 Hz frame).
    """

    def __init__(self, encoder: SpeechEncoder, reencode: bool = False) -> None:
        self.encoder = encoder
        # Host state only: the device rows of a fresh stream are read from the KV pool's blank row until its first step
        # writes its own (so no kernel on one CUDA stream makes state that another reads).
        self.mel: MelState = encoder.frontend.new_state()
        self.trunk: TrunkState = encoder.new_state(reencode)
        # The KV slot goes back to the pool on finalize/close, or when the stream is dropped.
        self._release = weakref.finalize(self, encoder.release_slot, self.trunk)
        self.codes_out = 0
        self.floor_from: tuple[int, float] | None = None  # (segment, peak) it was last started at (segment_floor.py)
        self.closed = False
        self.last_features: torch.Tensor | None = None  # [n, d] float32 pre-VQ features of the last codes

    @property
    def samples_seen(self) -> int:
        return self.mel.samples_seen

    def push(self, pcm: np.ndarray | torch.Tensor) -> list[int]:
        """Append 16 kHz mono float32 samples; return the codes that became determined."""
        return EncoderBatch(self.encoder).step([(self, pcm)])[0]

    def finalize(self, last: np.ndarray | None = None) -> list[int]:
        """Flush: the last partial 80 ms group is completed with silence (zeros); then the stream closes.
        `last`: samples to push first, in the same forward.

        After finalize, the stream has produced ceil(samples / 1280) codes in total.
        """
        return EncoderBatch(self.encoder).finalize([self], None if last is None else [last])[0]

    def close(self) -> None:
        """Drop the stream without flushing (e.g. the user's turn was cancelled); frees its KV slot."""
        self.closed = True
        self._release()

    def tail_padding(self, more: int = 0) -> int:
        """Zeros needed for the last started code to be determined (after `more` samples still to come)."""
        return self.encoder.tail_padding(self.samples_seen + more)


class EncoderBatch:
    """Steps many streams in one forward: each stream's result equals stepping it alone."""

    def __init__(self, encoder: SpeechEncoder, urgent: bool = True) -> None:
        self.encoder = encoder
        self.urgent = urgent

    @torch.no_grad()
    def step(self, items: list[tuple[EncoderStream, np.ndarray | torch.Tensor]]) -> list[list[int]]:
        with self.encoder._lane(self.urgent, len(items)), self.encoder._on_stream(self.urgent):
            try:
                return self._step(items)
            except BaseException:
                # Kernels it queued may still write its streams' rows: done before the lane (and those rows' slots,
                # once the caller closes the streams) goes to another call or a growth.
                wait_releasing_gil(self.encoder.device)
                raise

    def _step(self, items: list[tuple[EncoderStream, np.ndarray | torch.Tensor]]) -> list[list[int]]:
        enc = self.encoder
        streams = [s for s, _ in items]
        if len({id(s) for s in streams}) != len(streams):
            raise ValueError("a stream appears twice in one step")
        for s in streams:
            if s.closed:
                raise StreamClosedError("push on a finalized stream")
            if s.encoder is not enc:
                raise ValueError("stream belongs to another encoder")
        pcms = [_as_pcm(p) for _, p in items]
        for s in streams:
            if s.mel.peak is not None and s.mel.frames_done == 0:  # read by its first frames' floor (log_mel.py)
                enc.runner.kv.peaks[s.trunk.slot] = s.mel.peak
        codes: list[list[int]] = [[] for _ in streams]
        feats: list[list[torch.Tensor]] = [[] for _ in streams]
        seg = enc.cfg.mel_per_segment
        none = np.zeros(0, np.float32)
        more, waited = True, 0.0
        # Steps: no stream may run past its 30 s segment end inside one forward; what is left goes in the next.
        while more:
            limits = np.asarray([seg - s.trunk.mel_in_segment for s in streams], dtype=np.int64)
            counts, ids, pooled, more = enc.runner.run([s.trunk for s in streams], [s.mel for s in streams], pcms,
                                                       limits)
            pcms = [none] * len(streams)
            if ids is not None:
                t0 = time.perf_counter()
                wait_releasing_gil(ids.device)  # (the engine loop runs meanwhile when the encoder has a thread)
                waited += time.perf_counter() - t0
                ids_list = ids.tolist()
                start = 0
                for i, c in enumerate(counts):
                    codes[i].extend(ids_list[start:start + c])
                    if c:
                        feats[i].append(pooled[start:start + c])
                    start += c
            for s in streams:
                if s.trunk.mel_in_segment == seg:
                    enc.runner.reset_segment(s.trunk)
        enc.last_gpu_wait_s = waited
        for i, s in enumerate(streams):
            s.codes_out += len(codes[i])
            s.last_features = None if not feats[i] else feats[i][0] if len(feats[i]) == 1 else torch.cat(feats[i])
        return codes

    def finalize(self, streams: list[EncoderStream], last: list[np.ndarray] | None = None) -> list[list[int]]:
        """Finalize several streams in one forward (see `EncoderStream.finalize`); `last`: each stream's last
        samples, pushed in the same forward (== push(last) then finalize(), one encoder call instead of two)."""
        for s in streams:
            if s.closed:
                raise StreamClosedError("stream already finalized")
        last = last if last is not None else [np.zeros(0, np.float32)] * len(streams)
        out = self.step([(s, np.concatenate([_as_pcm(p), np.zeros(s.tail_padding(len(p)), np.float32)]))
                         for s, p in zip(streams, last, strict=True)])
        for s in streams:
            s.close()
        return out
