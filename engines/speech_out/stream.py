"""Per-session decode stream: pending codes, the chunk schedule, and the session's flow/vocoder state."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engines.speech_out.codes import validate_codes
from engines.speech_out.flow.full_context import FullState, first_job_codes
from engines.speech_out.flow.state import FlowState
from engines.speech_out.vocoder.vocoder import VocoderState

if TYPE_CHECKING:
    from engines.speech_out.decoder import CodecDecoder


@dataclass
class Job:
    """One chunk of one session: n codes, the real lookahead codes after them, and whether it is the last."""

    stream: DecodeStream
    codes: list[int]
    look: list[int]
    final: bool


@dataclass
class DecodeStream:
    """Per-session state. `push` / `finalize` decode at batch 1; `add` / `take_jobs` hand chunks to
    CodecDecoder.run_jobs, which decodes those of many streams in one batch (the engine's codec worker)."""

    decoder: CodecDecoder
    session_id: str
    flow_state: FlowState | FullState
    voc_state: VocoderState
    gen: torch.Generator
    pending: list[int] = field(default_factory=list)
    finished: bool = False
    closed: bool = False
    samples_out: int = 0
    # Recorded after the state was made on the opening thread's CUDA stream; `adopt` hands the state to the stream
    # that decodes it (None: nothing to hand over, or done).
    ready: torch.cuda.Event | None = None
    on_stream: int | None = None  # the CUDA stream (handle) the state was last handed to
    prompt_left: int = 0  # the voice prompt's tail codes at the front of `pending` (full-context flow)
    # Answer codes its first audio waits for: those of its first job past the prompt's tail, and their lookahead
    # (windowed, no tail: a chunk and its lookahead, 8; full context: 8-12 by the tail, 10 with the bundled voice's 3).
    first_audio_codes: int = field(init=False)

    def __post_init__(self) -> None:
        C, la = self.decoder.cfg.stream.chunk_codes, self.decoder.cfg.flow.pre_lookahead
        self.first_audio_codes = first_job_codes(self.prompt_left, C) - self.prompt_left + la

    def adopt(self) -> None:
        """Before a decode on the current CUDA stream, if the state was made or last decoded on another: wait there
        for the kernels that made it, and tell the allocator the state is used there. The state is made on the
        thread that opens the stream (the engine loop, on the language model's stream) and decoded on the codec
        worker's streams (a first chunk on one, the rest on another); without this, a state tensor that a decode
        replaces goes back to its first stream for reuse while the decode's kernels still read it, and the decode
        reads whatever that stream wrote there. (A decode on another stream needs no wait: the worker waited for it
        before reading its PCM.)"""
        if self.decoder.device.type != "cuda":
            return
        cur = torch.cuda.current_stream(self.decoder.device)
        if cur.cuda_stream == self.on_stream:
            return
        if self.ready is not None:
            cur.wait_event(self.ready)
            self.ready = None
        for st in (self.flow_state, self.voc_state):
            for f in dataclasses.fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(cur)
        self.on_stream = cur.cuda_stream

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"stream {self.session_id} is closed")
        if self.finished:
            raise RuntimeError(f"stream {self.session_id} was finalized")

    def add(self, codes) -> None:
        self._check_open()
        self.pending.extend(validate_codes(codes))

    def take_jobs(self, finishing: bool = False) -> list[Job]:
        """Chunks that can be decoded now (in order). With finishing, everything left, the last one final."""
        st = self.decoder.cfg.stream
        C, la = st.chunk_codes, self.decoder.cfg.flow.pre_lookahead
        jobs = []
        if self.prompt_left:
            n = first_job_codes(self.prompt_left, C)
            if len(self.pending) >= n + la or (finishing and len(self.pending) > self.prompt_left):
                n = min(n, len(self.pending))
                jobs.append(Job(self, self.pending[:n], self.pending[n:n + la], False))
                del self.pending[:n]
                self.prompt_left = 0
            elif not finishing:
                return []
        while len(self.pending) >= C + la:
            jobs.append(Job(self, self.pending[:C], self.pending[C:C + la], False))
            del self.pending[:C]
        if finishing:
            self._check_open()
            if self.prompt_left:  # an answer without codes: nothing to decode
                self.pending, self.prompt_left = [], 0
            while self.pending:
                n = min(C, len(self.pending))
                jobs.append(Job(self, self.pending[:n], self.pending[n:n + la], False))
                del self.pending[:n]
            if jobs:
                jobs[-1].final = True
            else:
                jobs.append(Job(self, [], [], True))  # only the held tail (if any) is left
            self.finished = True
        return jobs

    def push(self, codes) -> np.ndarray:
        """Add codes; returns the PCM (float32, 24 kHz) that became final, possibly empty."""
        self.add(codes)
        return self._run(self.take_jobs())

    def finalize(self) -> np.ndarray:
        """Decode what is left (the last chunk without lookahead) and release the held tail."""
        return self._run(self.take_jobs(finishing=True))

    def _run(self, jobs: list[Job]) -> np.ndarray:
        outs = [self.decoder.run_jobs_or_raise([j])[0] for j in jobs]
        return np.concatenate(outs) if outs else np.zeros(0, dtype=np.float32)

    def close(self) -> None:
        if self.decoder.full is not None and self.flow_state is not None:
            self.decoder.full.close(self.flow_state)
        self.closed = True
        self.flow_state = self.voc_state = None  # type: ignore[assignment]
        self.pending = []

    def state_bytes(self) -> int:
        return self.flow_state.nbytes()
