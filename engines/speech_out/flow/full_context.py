"""Streaming decode with the full left context the chunk models were trained with, at O(chunk) work per chunk.

The chunk model (`flow-chunk-5.pt`) attends, in its encoder and in its estimator, over its own chunk and every
earlier chunk of prompt and answer, chunks counted from the prompt's first code (`reference.py` runs that over a whole
sequence). Streaming it here keeps, instead of recomputing, what earlier chunks contribute: the encoder's keys and
values of every earlier code (small), its two convolutions' left caches, and for the estimator each step's keys and
values of every earlier frame (`EstimatorPages`) and its convolutions' last input frames (`cached_estimator.py`).
A chunk then costs the same compute wherever it falls in an answer; the attention reads grow with the answer.

When the estimator's cache runs short (fewer than LOW_WATER pages free), an answer that holds more than KEPT_PAGES
chunks with the one it is about to decode forgets its oldest as that one's page is taken: its estimator then attends
over the prompt and its last ~11 s (its encoder keeps every earlier code), where the trained algorithm hears the whole
answer. That happens only past ~11 s of answer with the cache short, and it keeps long answers going where they
would otherwise stop for want of a page (`DecoderCacheFull`).

A voice's prompt is prepared once (`prepare_voice`): its whole chunks whose lookahead stays inside the prompt are
encoded and solved with a fixed noise, and their pages are shared by every answer in that voice. The prompt's last
3..7 codes (its "tail") are decoded with each answer, in front of its codes, so that chunks stay aligned to the
prompt's start as in the reference; their mel frames are not part of the answer (`FullState.skip`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engines.cuda.host_copy import upload
from engines.speech_out.chunk_graphs import BucketGraphs
from engines.speech_out.flow.cached_estimator import estimate_chunk, left_channels, n_blocks, paged_kernel
from engines.speech_out.flow.conformer import key_factors
from engines.speech_out.flow.pages import DecoderCacheFull, EstimatorPages
from engines.speech_out.flow.reference import chunk_masks, encode_masked
from engines.speech_out.flow.state import GrowingKeys, append_keys, gather_keys, key_groups, key_table

log = logging.getLogger(__name__)

# The initial noise of a voice's shared prompt frames: one draw for the voice, the same for every answer in it.
VOICE_NOISE_SEED = 0
# Where a pass gathers pages (not in half precision on CUDA), a graphed solve's table holds a multiple of this many
# (6.4 s of audio): few graphs, a little padding read.
PAGES_BUCKET = 16
# First jobs' graphs captured at load reach this batch (more first jobs in one round capture theirs on first use).
FIRST_JOB_BATCH = 16
# Chunks an answer keeps whatever the cache's pressure, the one it decodes now included: ~11.2 s of audio. The
# server's session limit counts each session as holding this many (server/limits.py): 32 of them and a voice of 14
# pages fit the 40 GiB default of a card with room for it (936 pages).
KEPT_PAGES = 28
# Below this many free pages, answers longer than KEPT_PAGES forget their oldest chunks: room for a round of first
# jobs (FIRST_JOB_BATCH answers of 2 pages) taken between two rounds.
LOW_WATER = 2 * FIRST_JOB_BATCH
# Where the encoder gathers a round's keys (not on CUDA: there it reads them in place), every row padded to the longest
# of its group (`key_groups`), at most this many bytes a group: 32 answers padded to one of the output bound's 164 s
# would take 6.1 GB, past the engine's headroom for per-round tensors (engines/lm/kv/sizing.py).
ENCODER_BATCH_BYTES = 3 * 2**30
# Key positions (the up stack's frames: 50 a second) whose factors the encoder's attention reads from one table on
# CUDA: 327 s of voice prompt and answer, past the longest voice (30 s) and answer (164 s) together; a longer round
# gathers its keys instead. 32 MiB at full size (16 in float16).
KEY_POSITIONS = 16384
# At most one log line this often while answers forget chunks.
FORGET_LOG_S = 60.0


def pages_bucket(n: int) -> int:
    """The pages a graphed solve gathers for n: the next multiple of PAGES_BUCKET (one at least: a voice too short
    for a page of its own replays the graph of one that has some)."""
    return max(1, -(-n // PAGES_BUCKET)) * PAGES_BUCKET


def first_job_codes(tail: int, chunk: int) -> int:
    """An answer's first job: the prompt's tail and the answer's first codes up to the chunk boundary that gives at
    least a chunk of answer, so that the first audio is never shorter than a chunk (the next can follow in time)."""
    return -(-(tail + chunk) // chunk) * chunk


def prompt_tails(chunk: int, lookahead: int) -> range:
    """Every length a voice's tail can have (`FullContextFlow.prepare_voice`): a prompt shorter than the lookahead is
    all tail, a longer one leaves lookahead .. lookahead + chunk - 1 codes after its whole chunks."""
    return range(lookahead + chunk)


@dataclass
class FullVoice:
    """A voice as the full-context flow uses it, prepared once (`FullContextFlow.prepare_voice`)."""

    n_codes: int  # prompt codes in the shared whole chunks
    kv: torch.Tensor  # [layers, 2, n_codes, H, dk] the encoder's keys/values of those codes
    up_kv: torch.Tensor  # [up_layers, 2, n_codes * ratio, H, dk]
    pre: torch.Tensor  # [2, D] the lookahead layer's cache after them
    up: torch.Tensor  # [2 * ratio, D] the upsampling conv's cache after them
    tail: list[int]  # the prompt's other codes, decoded in front of each answer
    mel: torch.Tensor  # [80, 4P] the prompt's mel: the cond of every prompt frame
    spks: torch.Tensor  # [80] projected x-vector
    pages: list[int]  # estimator pages of the shared chunks (held by this voice)
    left: torch.Tensor  # [steps, 2, left_channels, 2] the estimator's convolution inputs before the tail


@dataclass
class FullState:
    """One answer's flow state (no batch dimension)."""

    voice: FullVoice
    pre: torch.Tensor
    up: torch.Tensor
    kv: GrowingKeys  # [layers, 2, N, H, dk] keys/values of this answer's codes so far (tail included)
    up_kv: GrowingKeys
    left: torch.Tensor
    shared: list[int] = field(default_factory=list)  # the voice's pages this answer holds
    pages: list[int] = field(default_factory=list)  # pages of this answer's decoded chunks
    reserved: deque = field(default_factory=deque)  # pages taken for chunks handed out but not yet decoded
    codes_done: int = 0  # tail + answer codes decoded
    skip: int = 0  # prompt frames at the start of the last decoded chunk (not the answer's)

    def run_key(self) -> tuple[int, int, int]:
        return id(self.voice), 0, 0

    def nbytes(self) -> int:
        ts = (self.pre, self.up, self.left)
        return sum(t.numel() * t.element_size() for t in ts) + self.kv.nbytes() + self.up_kv.nbytes()


class FullContextFlow:
    """The chunk model streamed with its full left context, for many answers at once (one chunk each per call).
    n_pages: the estimator's cache, in pages of one chunk; cache_dtype: their element type (default the estimator's;
    fp8 holds twice the chunks in the same memory, at fp8 rounding of every cached key and value)."""

    def __init__(self, flow, n_pages: int, kept_pages: int = KEPT_PAGES, low_water: int = LOW_WATER,
                 cache_dtype: torch.dtype | None = None, encoder_batch_bytes: int = ENCODER_BATCH_BYTES) -> None:
        self.flow = flow
        self.kept_pages, self.low_water = kept_pages, low_water
        self.encoder_batch_bytes = encoder_batch_bytes
        self.forgotten = 0  # pages answers have forgotten so far (the cache ran short)
        self._logged_at = -FORGET_LOG_S
        self._counting = threading.Lock()  # (answers are decoded on two codec threads)
        cfg, est = flow.cfg, flow.decoder.estimator
        self.chunk = flow.stream.chunk_codes
        self.page_frames = self.chunk * cfg.token_mel_ratio
        self.left_channels = left_channels(est)
        self.est_dtype = est.final_proj.weight.dtype  # (the left states' too)
        # One code's encoder keys and values in a round's batch tensors: both stacks, the up stack's `ratio` frames.
        enc = flow.encoder
        self.code_key_bytes = (2 * cfg.d_model * (len(enc.encoders) + len(enc.up_encoders) * cfg.token_mel_ratio)
                               * torch.finfo(flow.dtype).bits // 8)
        # [KEY_POSITIONS, D] the key factor of every position (CUDA), read by every layer of both stacks; in float16
        # where the encoder's float32 products round to TF32 (the same 10-bit mantissa: half the reads, same products)
        fdt = torch.float16 if flow.encoder_tf32 and flow.dtype == torch.float32 else flow.dtype
        self.factors = (key_factors(torch.arange(KEY_POSITIONS, device=flow.device), cfg.d_model, fdt)
                        if flow.device.type == "cuda" else None)
        self.pages = EstimatorPages(n_pages, cfg.n_timesteps, n_blocks(est), self.page_frames,
                                    cfg.est_heads * cfg.est_head_dim, flow.device, cache_dtype or self.est_dtype)
        # Called with the pages wanted when there are too few (the decoder drops voices no answer speaks in).
        self.reclaim: Callable[[int], None] | None = None

    def _alloc(self, n: int) -> list[int]:
        try:
            return self.pages.alloc(n)
        except DecoderCacheFull:
            if self.reclaim is None:
                raise
            self.reclaim(n)
            return self.pages.alloc(n)

    # ---- voices and answers ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare_voice(self, codes: torch.Tensor, mel: torch.Tensor, xvector: torch.Tensor) -> FullVoice:
        """codes [P] long, mel [80, 4P], xvector [spk_embed_dim] -> the voice's shared part (its pages taken)."""
        f, cfg = self.flow, self.flow.cfg
        dev, dt, r, la = f.device, f.dtype, cfg.token_mel_ratio, cfg.pre_lookahead
        spks = f.speaker(xvector)
        P = int(codes.shape[0])
        k = max(0, (P - la) // self.chunk)  # whole chunks whose lookahead stays inside the prompt
        n = k * self.chunk
        tail = codes[n:].tolist()  # (on the host: a voice may be prepared on the engine loop, which never syncs)
        codes = codes.to(dev)
        empty = f.encoder.empty_cache(1, dev, dt)
        pre, up = empty.pre[0], empty.up[0]
        kv, up_kv = self._empty_kv(False), self._empty_kv(True)
        left = torch.zeros(cfg.n_timesteps, 2, self.left_channels, 2, device=dev, dtype=self.est_dtype)
        voice = FullVoice(n, kv, up_kv, pre, up, tail, mel.to(dev, dt), spks, [], left)
        if n == 0:
            return voice
        # The shared codes in one chunk-masked encoder call, their lookahead the prompt's next codes.
        mu, cache, kvs, up_kvs = encode_masked(f, codes[:n], codes[n:n + la], self.chunk)  # mu [80, n * ratio]
        voice.kv, voice.up_kv = (torch.stack([torch.stack([a[0], b[0]]) for a, b in x]) for x in (kvs, up_kvs))
        voice.pre, voice.up = cache.pre[0], cache.up[0]
        gen = torch.Generator(device=dev).manual_seed(VOICE_NOISE_SEED)
        z = torch.randn(cfg.output_size, n * r, generator=gen, device=dev, dtype=dt)
        voice.pages = self._alloc(k)
        state = self._state(voice)
        try:  # every shared chunk in one solve, under the chunk mask between them
            self._solve([state], mu[None], voice.mel[None, :, :n * r], z[None], [[]], [voice.pages])
        except BaseException:
            self.pages.release(voice.pages)
            raise
        voice.left = state.left
        return voice

    def forget_voice(self, voice: FullVoice) -> None:
        """The voice's own hold on its pages ends (answers in it keep theirs)."""
        self.pages.release(voice.pages)
        voice.pages = []

    def _empty_kv(self, up: bool) -> torch.Tensor:
        return self.flow._empty_kv(up)

    def _state(self, voice: FullVoice) -> FullState:
        return FullState(voice, voice.pre, voice.up, GrowingKeys(self._empty_kv(False)),
                         GrowingKeys(self._empty_kv(True)), voice.left.clone())

    def new_state(self, voice: FullVoice) -> FullState:
        """An answer in `voice`: it reads (and holds) the voice's pages."""
        self.pages.share(voice.pages)
        state = self._state(voice)
        state.shared = list(voice.pages)
        return state

    def reserve(self, state: FullState, n: int) -> None:
        """Pages for the next n chunks of `state`, taken before its job joins a batch, so that running out ends only
        this answer; with the cache short, voices nobody speaks in are dropped, then its oldest chunks forgotten (the
        module's doc). Called as its job's round starts: its earlier jobs have all run."""
        if n:
            if self.pages.n_free - n < self.low_water and self.reclaim is not None:
                self.reclaim(n + self.low_water)  # voices nobody speaks in go before any answer's context
            if self.pages.n_free - n < self.low_water:
                self._forget_oldest(state, n)
            state.reserved.extend(self._alloc(n))

    def close(self, state: FullState) -> None:
        self.pages.release([*state.shared, *state.pages, *state.reserved])
        state.shared, state.pages, state.reserved = [], [], deque()

    # ---- one chunk of a batch of answers -----------------------------------------------------------------
    @staticmethod
    def pages_for(n: int, chunk: int) -> int:
        """Pages a job of n codes takes (an answer's first job may hold several chunks: `decode_chunk`)."""
        return -(-n // chunk)

    @torch.inference_mode()
    def decode_chunk(self, states: list[FullState], codes: torch.Tensor, n: int, n_look: list[int],
                     gens: list[torch.Generator], graphs: BucketGraphs | None = None,
                     enc_graphs: BucketGraphs | None = None) -> torch.Tensor:
        """codes [B, n + pre_lookahead] long (lookahead slots beyond n_look[b] are ignored), every state with its
        pages reserved -> mel [B, 80, n * ratio] (its first `state.skip` frames are the prompt's). n may exceed a chunk
        only where every state is at a chunk boundary (an answer's first job: the prompt's tail and its first codes):
        its chunks then go through the encoder and the solve together, under the chunk mask between them, one pass
        each instead of one per chunk (the same result: each chunk's own pass would see exactly the earlier ones).
        `graphs`, `enc_graphs`: the caller's `FullSolveGraphs` and `FullEncoderGraphs` (CUDA; full_graphs.py)."""
        f, cfg, C = self.flow, self.flow.cfg, self.chunk
        dev, dt, r = f.device, f.dtype, cfg.token_mel_ratio
        B, Fr, c = len(states), n * r, self.pages_for(n, C)
        done = [s.voice.n_codes + s.codes_done for s in states]  # codes before the job, prompt included
        if c > 1 and any(d % C for d in done):
            raise ValueError("a job of several chunks must start at a chunk boundary")
        mu, new_kv, new_up_kv, pre, up = self._encode_groups(states, codes, n, n_look, done, enc_graphs)
        cond = torch.zeros(B, cfg.output_size, Fr, device=dev, dtype=dt)
        for b, s in enumerate(states):
            g0 = done[b] * r
            s.skip = min(Fr, max(0, s.voice.mel.shape[1] - g0))
            if s.skip:
                cond[b, :, :s.skip] = s.voice.mel[:, g0:g0 + s.skip]
        # Each chunk's noise drawn in turn, as a job of one chunk would draw it: the same noise per frame however an
        # answer's codes are split into jobs.
        W = self.page_frames
        z = torch.stack([torch.cat([torch.randn(cfg.output_size, min(W, Fr - i), generator=g, device=dev, dtype=dt)
                                    for i in range(0, Fr, W)], 1) if c > 1 else
                         torch.randn(cfg.output_size, Fr, generator=g, device=dev, dtype=dt) for g in gens])
        # The job's pages stay reserved until its solve has run: a solve that fails leaves them to `close`.
        new_pages = [[s.reserved[i] for i in range(c)] for s in states]
        x = self._solve(states, mu, cond, z, [s.shared + s.pages for s in states], new_pages, graphs)
        append_keys([s.kv for s in states], new_kv)
        append_keys([s.up_kv for s in states], new_up_kv)
        for b, s in enumerate(states):
            for _ in range(c):
                s.reserved.popleft()
            s.pages.extend(new_pages[b])
            s.pre, s.up = pre[b], up[b]
            s.codes_done += n
        return x

    def _forget_oldest(self, state: FullState, wanted: int) -> None:
        """The answer's oldest pages back to the pool, until it holds `kept_pages` with the `wanted` ones. Only this
        answer's earlier jobs read them, and each of those has finished (its audio came back to the host before this
        job was handed to a round: an answer's jobs run one after another) or, in a round queued ahead on the same
        stream (queued.py), runs before anything queued after it, so they may be written again at once."""
        n = min(len(state.pages), len(state.pages) + len(state.reserved) + wanted - self.kept_pages)
        if n > 0:
            self.pages.release(state.pages[:n])
            del state.pages[:n]
            with self._counting:
                self.forgotten += n
                now = time.monotonic()
                due = now - self._logged_at >= FORGET_LOG_S
                if due:
                    self._logged_at = now
            if due:
                log.warning("the speech decoder's cache is short (%d of %d pages free): answers longer than %d chunks "
                            "forget their oldest (%d pages forgotten so far; --decoder-cache-gib sizes the cache)",
                            self.pages.n_free, self.pages.n_pages, self.kept_pages, self.forgotten)

    def _encode_groups(self, states: list[FullState], codes: torch.Tensor, n: int, n_look: list[int],
                       done: list[int], graphs: BucketGraphs | None = None):
        """`_encode` of the batch: where the encoder reads the answers' keys in place (`_encode_rows`), one call; else
        in groups of rows whose padded keys stay within `encoder_batch_bytes` (one call when the batch fits), its
        outputs in the batch's order."""
        r = self.flow.cfg.token_mel_ratio
        if self.factors is not None and (max(done) + n) * r <= self.factors.shape[0]:
            return self._encode_rows(states, codes, n, n_look, done, graphs)
        groups = key_groups(done, self.code_key_bytes, self.encoder_batch_bytes)
        if len(groups) == 1:
            return self._encode(states, codes, n, n_look, done)
        outs = [self._encode([states[i] for i in g], codes[g], n, [n_look[i] for i in g], [done[i] for i in g])
                for g in groups]
        order = upload([np.argsort(np.concatenate(groups))], self.flow.device)[0]  # rows back in the batch order
        return tuple(torch.cat(parts)[order] for parts in zip(*outs, strict=True))

    def _encode_inputs(self, states: list[FullState], codes: torch.Tensor, n: int, n_look: list[int],
                       done: list[int], tables: Sequence[np.ndarray] = ()) -> tuple[torch.Tensor, ...]:
        """What every way of encoding a job takes: codes, their validity (absent lookahead zeroed), the conv caches
        and the new codes' positions in both stacks (a row's first is after all its earlier codes); then `tables`,
        on the device, uploaded in the same copy."""
        f, cfg = self.flow, self.flow.cfg
        dev, r, la = f.device, cfg.token_mel_ratio, cfg.pre_lookahead
        B = len(states)
        # (one pinned copy: no stream sync)
        d, look, *tables = upload([np.asarray(done)[:, None], np.asarray(n_look)[:, None], *tables], dev)
        valid = torch.cat([torch.ones(B, n, dtype=torch.bool, device=dev),
                           torch.arange(la, device=dev)[None] < look], 1)
        pre, up = torch.stack([s.pre for s in states]), torch.stack([s.up for s in states])
        return (codes.to(dev), valid, pre, up, d + torch.arange(n, device=dev),
                d * r + torch.arange(n * r, device=dev), *tables)

    def _encode_rows(self, states: list[FullState], codes: torch.Tensor, n: int, n_look: list[int],
                     done: list[int], graphs: BucketGraphs | None = None):
        """`_encode` with the encoder's attention reading each answer's earlier keys where they are (CUDA:
        `encode_rows`), replayed from `graphs` when given."""
        voices = [s.voice for s in states]
        inputs = list(self._encode_inputs(states, codes, n, n_look, done, [
            key_table([v.kv for v in voices], [s.kv for s in states]),
            key_table([v.up_kv for v in voices], [s.up_kv for s in states])]))
        mu, pre, up, new_kv, new_up_kv = graphs.run(inputs) if graphs is not None else self.encode_rows(*inputs)
        return mu, new_kv, new_up_kv, pre, up

    def encode_rows(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`FlowModel.encode_rows` of `_encode_rows`' inputs (codes, valid, pre, up, pos, up_pos, table, up_table): the
        function its graphs replay."""
        return self.flow.encode_rows(*inputs, self.factors, self.chunk)

    def _encode(self, states: list[FullState], codes: torch.Tensor, n: int, n_look: list[int], done: list[int]):
        """The job's codes through the encoder, each row after all its earlier codes' keys (the voice's, then its own)
        gathered into one batch tensor; a job of several chunks under the chunk mask between its own codes."""
        f, r = self.flow, self.flow.cfg.token_mel_ratio
        dev = f.device
        B, L = len(states), max(done)
        voices = [s.voice for s in states]
        X = gather_keys([v.kv for v in voices], [s.kv for s in states], L)  # [B, layers, 2, L, H, dk]
        upX = gather_keys([v.up_kv for v in voices], [s.up_kv for s in states], L * r)
        codes, valid, pre, up, pos, up_pos = self._encode_inputs(states, codes, n, n_look, done)
        d = pos[:, :1]
        kpos, up_kpos = torch.arange(L, device=dev).expand(B, L), torch.arange(L * r, device=dev).expand(B, L * r)
        blocked = chunk_masks(n, self.chunk, r, dev) if n > self.chunk else (None, None)
        mu, pre, up, new_kv, new_up_kv = f.encode(
            codes, valid, pre, up, pos, up_pos, X, kpos, kpos < d, upX, up_kpos, up_kpos < d * r, *blocked)
        return mu, new_kv, new_up_kv, pre, up

    def _solve(self, states: list[FullState], mu: torch.Tensor, cond: torch.Tensor, z: torch.Tensor,
               tables: list[list[int]], new_pages: list[list[int]], graphs: BucketGraphs | None = None
               ) -> torch.Tensor:
        """The Euler solve of one job per state: mu, cond, z [B, 80, F] -> mel [B, 80, F]; each state's estimator
        reads the pages in `tables` and writes its job's chunks to `new_pages` (one page per chunk); its left state
        moves on. The frames are padded to whole chunks (a last chunk runs as a whole one with its real frames marked).
        With `graphs`, a job replays a CUDA graph per (batch bucket, chunks) and table width (`graph_pages`; the
        padding is page 0: attention reading the pages in place stops at each row's own, a gathering pass masks it)."""
        dev, Fr, W = mu.device, mu.shape[2], self.page_frames
        c = len(new_pages[0])
        if Fr < c * W:
            mu, cond, z = (F.pad(t, (0, c * W - Fr)) for t in (mu, cond, z))
        maxp = max(len(t) for t in tables)
        if graphs is not None:
            maxp = self.graph_pages(maxp)
        padded = np.zeros((len(tables), maxp), np.int64)  # [B, maxp]
        for b, t in enumerate(tables):
            padded[b, :len(t)] = t
        table, n_keys, new_page, n_new = upload([
            padded,
            np.asarray([len(t) * W for t in tables]), np.asarray(new_pages, np.int64).reshape(len(tables), c),
            np.full(len(tables), Fr)], dev)
        args = [mu, cond, z, torch.stack([s.voice.spks for s in states]), torch.stack([s.left for s in states]), table,
                n_keys, new_page, n_new]
        x, left = graphs.run(args) if graphs is not None else self.euler(*args)
        for b, st in enumerate(states):
            st.left = left[b]  # (after a padded last chunk, never read again)
        return x[:, :, :Fr]

    def graph_pages(self, n: int) -> int:
        """The width of a graphed solve's page table for rows of at most n earlier pages: where attention reads the
        pages in place, the pool's size (its work follows each row's own length: one graph of a batch serves answers
        and voices of any length, none is captured while serving); where a pass gathers the table, the next multiple
        of PAGES_BUCKET."""
        return self.pages.n_pages if paged_kernel(self.pages.pool, self.flow.decoder.estimator) else pages_bucket(n)

    def euler(self, mu: torch.Tensor, cond: torch.Tensor, z: torch.Tensor, spks: torch.Tensor, left: torch.Tensor,
              table: torch.Tensor, n_keys: torch.Tensor, new_page: torch.Tensor, n_new: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The solve as a function of tensors (what a graph replays; no host syncs): mu, cond, z [B, 80, F] (F whole
        chunks); spks [B, 80]; left [B, steps, 2, Lc, 2]; table [B, maxp], n_keys [B], new_page [B, chunks], n_new [B]
        long (`estimate_chunk`).
        Returns mel [B, 80, F] and the new left state."""
        f, cfg = self.flow, self.flow.cfg
        est = f.decoder.estimator
        dev, edt = mu.device, est.final_proj.weight.dtype
        B, n80, Fr = mu.shape
        times = est.time_table(f.t_span, f.dtype)  # [steps, n_resnets, 1, C]
        h = torch.zeros(2, B, 4 * n80, Fr, device=dev, dtype=edt)  # [conditional; unconditional] estimator inputs
        h[0, :, n80:2 * n80] = mu
        h[0, :, 2 * n80:3 * n80] = spks[:, :, None]
        h[0, :, 3 * n80:] = cond
        left = left.clone()  # [B, steps, 2, Lc, 2] (an input buffer stays as it was)
        Lc = left.shape[3]
        x = z
        for s in range(cfg.n_timesteps):
            t0, t1 = f.t_span[s], f.t_span[s + 1]
            h[:, :, :n80] = x
            ls = left[:, s].transpose(0, 1).reshape(2 * B, Lc, 2)
            v, nl = estimate_chunk(est, h.view(2 * B, 4 * n80, Fr), times[s], ls, self.pages.pool[s], table, n_keys,
                                   new_page, n_new)
            left[:, s] = nl.view(2, B, Lc, 2).transpose(0, 1)
            x = torch.add(x, v[:B], alpha=(t1 - t0) * (1.0 + cfg.cfg_rate))
            x = torch.add(x, v[B:], alpha=-(t1 - t0) * cfg.cfg_rate)
        return x, left
