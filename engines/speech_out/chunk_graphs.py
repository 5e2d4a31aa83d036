"""CUDA graphs for the codec's launch-bound stages: the flow's encoder (hundreds of small kernels per chunk: ~8.6 ms
of Python and launches for ~1 ms of GPU work at batch 1), the flow's Euler solve (10 steps x ~800 small kernels per
chunk) and the HiFT vocoder (~600 small kernels per window). All are launch-bound at streaming batch sizes.

One graph per (padded batch, input shapes, static arguments). Batches are padded up to the smallest captured size by
repeating the last row (rows are independent, so real rows are unchanged) and outputs are sliced back. Sizes are
powers of two (`BUCKETS`), or for the steady state's full chunks of the solve and the vocoder, where a round of
playing answers spends its GPU time, finer steps (`FINE_BUCKETS`): at ~130 sessions on an H200 those rounds hold
~30 answers, around the step from 32 to 64 (solve graph 28.6 against 43.2 ms there). Opt-in
(`CodecDecoder.load(..., cuda_graphs=True)`); the eager path is the reference and runs the very same function.
Graphs are captured on first use; `capture_steady_state` captures the steady-state window of every bucket ahead of
time (the engine process does it at load), so no user's answer pays a capture. Anything random is drawn outside
the graph with each session's generator and passed in as an input.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engines.cuda.host_copy import PinnedMirror
from engines.lm.step_graphs import capture_graph, private_stream
from engines.speech_out.flow.state import padded_prefix

log = logging.getLogger("engines.audio")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Quarter steps between powers of two from 16 (half steps below, where a solve's time grows slowly with its batch):
# a batch is padded by at most 25% above 16 (by up to 100% with BUCKETS).
FINE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def bucket(b: int, sizes: tuple[int, ...] = BUCKETS) -> int:
    for s in sizes:
        if b <= s:
            return s
    return b


def buckets_up_to(max_batch: int, sizes: tuple[int, ...] = BUCKETS) -> list[int]:
    """Every size of `sizes` up to and including the one holding `max_batch` rows, largest first: the order to capture
    them in. A graph set's captures share one memory pool, and a smaller capture reuses what a larger one freed;
    captured smallest first, a larger one may need blocks that the earlier ones' (split around their outputs, which
    stay allocated) cannot give."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    top = bucket(max_batch, sizes)
    return [top] + [b for b in reversed(sizes) if b < top]


class BucketGraphs:
    """Replays `fn(*tensors, *static) -> tuple of tensors` (every tensor batch-first) as one CUDA graph per key."""

    # Set once a server is serving (engines/process/loading.py): from then on every capture is logged as a warning,
    # since a capture stalls its caller and runs while other threads use the GPU.
    warn_captures = False

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], urgent: bool = False) -> None:
        self.fn = fn
        self.pool = None
        # Replays run at the priority of the capture stream (engines.lm.step_graphs.private_stream), made at first use:
        # urgent for the owners whose calls someone waits on (first chunks, commits), else the least.
        self.urgent = urgent
        self.stream: torch.cuda.Stream | None = None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self._sizes: dict[tuple, list[int]] = {}  # key without its batch -> the batches captured for it, ascending
        self.last_batch = 0  # the (padded) batch `run` replayed last (load logs: CodecDecoder.counts)

    @staticmethod
    def key(inputs: Sequence[torch.Tensor], static: tuple) -> tuple:
        return (inputs[0].shape[0], *(tuple(t.shape[1:]) for t in inputs), *static)

    def padded(self, batch: int, inputs: Sequence[torch.Tensor], static: tuple = ()) -> int:
        """The batch a call of `batch` rows with these shapes replays: the smallest captured one that holds it, but
        never more than its power-of-two bucket (that one is captured on first use)."""
        return self._padded(batch, self.key(inputs, static)[1:])

    def _padded(self, batch: int, rest: tuple) -> int:
        """`padded` for the key without its batch, `rest`."""
        top = bucket(batch)
        return next((s for s in self._sizes.get(rest, ()) if batch <= s <= top), top)

    def _static_inputs(self, key: tuple, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's own input buffers (replays read them), holding copies of `inputs`."""
        return [t.clone() for t in inputs]

    def _capture(self, key: tuple, inputs: Sequence[torch.Tensor], static: tuple):
        t0 = time.perf_counter()
        static_in = self._static_inputs(key, inputs)
        # The warm-up runs also make cuFFT plans and settle the allocator outside the graph.
        if self.stream is None:
            self.stream = private_stream(inputs[0].device, urgent=self.urgent)
        g, out = capture_graph(lambda: self.fn(*static_in, *static), self.stream, self.pool)
        self.pool = g.pool()
        if BucketGraphs.warn_captures:
            log.warning("%s: CUDA graph captured while serving in %.0f ms, key %s", type(self).__name__,
                        (time.perf_counter() - t0) * 1e3, self.key(inputs, static))
        return g, static_in, out

    def ensure(self, inputs: Sequence[torch.Tensor], static: tuple = (), key: tuple | None = None) -> bool:
        """Capture the graph for these (already bucket-sized) inputs unless it exists (`key`: theirs, if the caller
        has it). True if newly captured."""
        k = key if key is not None else self.key(inputs, static)
        if k in self.graphs:
            return False
        self.graphs[k] = self._capture(k, inputs, static)
        sizes = self._sizes.setdefault(k[1:], [])
        sizes.append(k[0])
        sizes.sort()
        return True

    def may_capture(self) -> bool:
        """Whether `run` may capture a graph it lacks (else it runs `fn` eagerly)."""
        return True

    def run(self, inputs: Sequence[torch.Tensor], static: tuple = ()) -> tuple[torch.Tensor, ...]:
        B = inputs[0].shape[0]
        rest = self.key(inputs, static)[1:]
        Bp = self._padded(B, rest)
        k = (Bp, *rest)
        if k not in self.graphs and not self.may_capture():
            return self.fn(*inputs, *static)
        self.last_batch = Bp
        if Bp != B:
            inputs = [torch.cat([t, t[-1:].expand(Bp - B, *t.shape[1:])]) for t in inputs]
        self.ensure(inputs, static, k)
        for dst, src in zip(self.graphs[k][1], inputs, strict=True):
            dst.copy_(src)
        return self.replay(k, B)

    def replay(self, key: tuple, batch: int) -> tuple[torch.Tensor, ...]:
        """Replay the graph of `key` on what its input buffers hold; its outputs' first `batch` rows (copies: the next
        replay overwrites the graph's own)."""
        g, _, out = self.graphs[key]
        g.replay()
        return tuple(o[:batch].clone() for o in out)


class EulerGraphs(BucketGraphs):
    def __init__(self, flow, urgent: bool = False) -> None:
        super().__init__(flow.euler, urgent)
        self.flow = flow

    @torch.inference_mode()  # as run_jobs: no autograd state in the captured solve
    def capture_steady_state(self, max_batch: int, frames: Sequence[int] | None = None) -> int:
        """Capture the graphs of the windows est_ctx_frames + F (F in `frames`; default a full chunk's frames), one
        per piece of the solve (FlowModel.step_ranges), for every bucket up to the one holding `max_batch` sessions.
        Returns how many were newly captured."""
        flow, n = self.flow, 0
        kw = {"device": flow.device, "dtype": flow.dtype}
        full = flow.stream.chunk_codes * flow.cfg.token_mel_ratio
        for F in sorted(frames or (full,), reverse=True):  # largest first, as buckets_up_to
            for Bp in buckets_up_to(max_batch, FINE_BUCKETS if F == full else BUCKETS):
                for steps in flow.step_ranges(F):
                    # Values are replaced at every replay.
                    n += self.ensure([torch.zeros(shape, **kw) for shape in self.input_shapes(Bp, F)], steps)
        return n

    def input_shapes(self, batch: int, frames: int | None = None) -> list[tuple[int, ...]]:
        """Shapes of z, ctx_traj, mu_w, cond_w, spks (as FlowModel._solve builds them) for `frames` new mel frames
        (default a full chunk's)."""
        cfg, C = self.flow.cfg, self.flow.stream.est_ctx_frames
        F = frames if frames is not None else self.flow.stream.chunk_codes * cfg.token_mel_ratio
        n = cfg.output_size
        return [(batch, n, F), (batch, cfg.n_timesteps, n, C), (batch, n, C + F), (batch, n, C + F), (batch, n)]

    def run(self, z, ctx_traj, mu_w, cond_w, spks, steps: tuple[int, int] | None = None  # type: ignore[override]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """FlowModel.euler over Euler steps `steps` = (s0, s1) (default all); one graph per range."""
        x, traj = super().run([z, ctx_traj, mu_w, cond_w, spks], steps or (0, self.flow.cfg.n_timesteps))
        return x, traj


class EncoderGraphs(BucketGraphs):
    """The flow's encoder for one full chunk (`FlowModel.encode`). Its shapes are (batch bucket, prefix lengths of the
    two stacks): positions and validity are inputs, and prefixes are padded to PREFIX_ALIGN keys, so a voice of P
    prompt codes needs one graph per distinct padded (P + W, ratio x (P + W)) over the windows W a full chunk sees.

    Graphs are captured on first use until `capture_steady_state` has run; after it, shapes not captured (another
    voice's prompt length) run eagerly: a capture would stall answers for 0.1-0.5 s, and every graph keeps its own
    copy of its prefix keys (at full size with a 30 s prompt ~36 MB per row, ~2.3 GB at batch 64).

    A captured graph's index inputs (codes, positions, validity: `INDEX_FIELDS`) are views of one flat buffer with a
    pinned host mirror, so the chunk's caller can write every input in place (`buffers`, then `replay_staged`): the
    indices into the mirror, copied over in one host -> device copy, and the state straight into the graph's buffers,
    instead of building the inputs and copying each in (the host time before a batch-1 chunk's first kernel)."""

    # of FlowModel.encode's arguments (flow.state.EncodeInputs): the int64 tensors
    INDEX_FIELDS = (0, 1, 4, 5, 7, 8, 10, 11)

    def __init__(self, flow, urgent: bool = False) -> None:
        super().__init__(flow.encode, urgent)
        self.flow = flow
        self.frozen = False  # set by capture_steady_state: no more captures
        # key -> the host mirror of the flat buffer its index inputs view, and that mirror split as those inputs
        self.staged: dict[tuple, tuple[PinnedMirror, list[np.ndarray]]] = {}
        self._rest: dict[tuple[int, int], tuple] = {}  # (L, U) -> a key's input shapes past the batch (`buffers`)

    def layout(self, L: int, U: int) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
        """(shape of one row, dtype, a harmless fill value) of each input of a full chunk with prefix lengths L (codes
        stack) and U (up stack), in FlowModel.encode's order."""
        flow = self.flow
        cfg, st = flow.cfg, flow.stream
        n, r, la, D, H = st.chunk_codes, cfg.token_mel_ratio, cfg.pre_lookahead, cfg.d_model, cfg.heads
        nl, nu, i, f = len(flow.encoder.encoders), len(flow.encoder.up_encoders), torch.long, flow.dtype
        return [((n + la,), i, 0), ((n + la,), i, 1), ((2, D), f, 0), ((2 * r, D), f, 0), ((n,), i, 0),
                ((n * r,), i, 0), ((nl, 2, L, H, D // H), f, 0), ((L,), i, 0), ((L,), i, 1),
                ((nu, 2, U, H, D // H), f, 0), ((U,), i, 0), ((U,), i, 1)]

    def _static_inputs(self, key: tuple, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = super()._static_inputs(key, inputs)
        idx = [inputs[i] for i in self.INDEX_FIELDS]
        flat = torch.cat([t.reshape(-1) for t in idx])
        for i, part in zip(self.INDEX_FIELDS, flat.split([t.numel() for t in idx]), strict=True):
            out[i] = part.view(inputs[i].shape)
        mirror = PinnedMirror(flat)
        sizes = np.cumsum([out[i].numel() for i in self.INDEX_FIELDS])[:-1]
        self.staged[key] = mirror, [a.reshape(out[i].shape)
                                    for i, a in zip(self.INDEX_FIELDS, np.split(mirror.array, sizes), strict=True)]
        return out

    def buffers(self, batch: int, L: int, U: int) -> tuple[tuple, list[torch.Tensor], list[np.ndarray]] | None:
        """For a full chunk of `batch` rows with prefix lengths (L, U), if its graph is captured: (its key, its input
        buffers in FlowModel.encode's order, padded batch first, and its index inputs (INDEX_FIELDS) as host arrays
        of the same shapes) to be written in place and then replayed (`replay_staged(key, batch)`). Rows past `batch`
        may keep an earlier call's values: rows are independent and theirs are not read."""
        rest = self._rest.get((L, U))
        if rest is None:  # (host time before a batch-1 chunk's first kernel: built once per prefix length)
            rest = self._rest[(L, U)] = tuple(shape for shape, _, _ in self.layout(L, U))
        key = (self._padded(batch, rest), *rest)
        if key not in self.graphs:
            return None
        mirror, arrays = self.staged[key]
        mirror.wait()
        return key, self.graphs[key][1], arrays

    def replay_staged(self, key: tuple, batch: int) -> tuple[torch.Tensor, ...]:
        """`replay` after copying the index inputs written into `buffers`' host arrays over."""
        self.staged[key][0].upload()
        return self.replay(key, batch)

    @torch.inference_mode()  # as run_jobs
    def capture_steady_state(self, max_batch: int, prompt_codes: int) -> int:
        """Capture every full-chunk graph of a voice with `prompt_codes` prompt codes for every bucket up to the one
        holding `max_batch` sessions. Returns how many were newly captured."""
        dev, got = self.flow.device, 0
        for L, U in reversed(self.prefix_lengths(prompt_codes)):  # largest first, as buckets_up_to
            for Bp in buckets_up_to(max_batch):
                # Values are replaced at every replay.
                got += self.ensure([torch.full((Bp, *shape), fill, device=dev, dtype=dt)
                                    for shape, dt, fill in self.layout(L, U)])
        self.frozen = True
        return got

    def prefix_lengths(self, prompt_codes: int) -> list[tuple[int, int]]:
        """The padded prefix lengths (codes stack, up stack) a full chunk can see after a prompt of `prompt_codes`:
        windows of 0, 1, ... enc_left_chunks previous full chunks."""
        st, r = self.flow.stream, self.flow.cfg.token_mel_ratio
        lens = [prompt_codes + w * st.chunk_codes for w in range(st.enc_left_chunks + 1)]
        return sorted({(padded_prefix(n), padded_prefix(n * r)) for n in lens})

    def may_capture(self) -> bool:
        return not self.frozen

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        """FlowModel.encode's arguments, in its order; returns its outputs (eagerly for a shape not captured once
        frozen)."""
        return super().run(list(inputs))


class VocoderGraphs(BucketGraphs):
    """HiFT's generator: inputs mel [B, 80, T], phase0 [B, H], noise [B, H, T * hop]; static keep_at (samples)."""

    def __init__(self, generator, ctx_frames: int, chunk_frames: int, urgent: bool = False) -> None:
        super().__init__(generator, urgent)
        self.generator, self.ctx_frames, self.chunk_frames = generator, ctx_frames, chunk_frames

    @torch.inference_mode()  # as run_jobs
    def capture_steady_state(self, max_batch: int, frames: Sequence[int] | None = None) -> int:
        """The windows voc_ctx_frames + F (F in `frames`, default a full chunk's frames; carried phase at the
        chunk's end) for every bucket up to the one holding `max_batch` sessions. Returns graphs newly captured."""
        gen = self.generator
        w = gen.conv_pre.weight
        cfg, H = gen.cfg, gen.n_harmonics
        hop = cfg.mel.hop
        n, kw = 0, {"device": w.device, "dtype": w.dtype}
        for F in sorted(frames or (self.chunk_frames,), reverse=True):  # largest first, as buckets_up_to
            T = self.ctx_frames + F
            for Bp in buckets_up_to(max_batch, FINE_BUCKETS if F == self.chunk_frames else BUCKETS):
                inputs = [torch.zeros(Bp, cfg.mel.n_mels, T, **kw), torch.zeros(Bp, H, **kw),
                          torch.zeros(Bp, H, T * hop, **kw)]
                n += self.ensure(inputs, (F * hop,))
        return n
