"""Token -> mel flow (`CausalMaskedDiffWithXvec` layout), decoded chunk by chunk for many sessions at once.

Per chunk of n codes (n = 5 except a final partial chunk) with up to 3 lookahead codes:
  1. embedding + upsampling conformer encoder (prompt + window attention, cached) -> mu [80, 4n]
  2. Euler solve of the CFM ODE (cosine time schedule, classifier-free guidance) over a window made of the
     previous chunk's last `est_ctx_frames` frames (their stored x_t trajectories, fixed) and the new frames
     (fresh per-session noise). Only the new frames are integrated.
State kept per session is bounded (window of KV, trajectories of one chunk), so a chunk costs the same at
any point of an answer.

Both stages replay as CUDA graphs (chunk_graphs.py) for full chunks: the Euler solve (`euler`) and the encoder
(`encode`: embedding, conformer stacks, projection). The encoder's shapes are static per (batch bucket, prefix length):
the relative positions need no distance table (conformer.AttnContext), and the prompt + window keys are padded (masked)
to a multiple of PREFIX_ALIGN, so a voice sees only a few prefix lengths over a whole answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engines.cuda.host_copy import upload
from engines.cuda.precision import float32_matmuls
from engines.cuda.streams import side_by_side
from engines.lm.step_graphs import SideStreams
from engines.speech_out.config import FlowConfig, StreamConfig
from engines.speech_out.flow.conformer import KV, EncoderCache, KeyRows, UpsampleConformerEncoder
from engines.speech_out.flow.estimator import CausalConditionalDecoder, window_mask
from engines.speech_out.flow.state import EncodeInputs, FlowState, PreparedVoice, padded_prefix
from engines.speech_out.mel_spec import SILENCE_LOG_MEL

# A solve of 2..CHAIN_MAX_SESSIONS sessions runs the estimator's windows (each session's conditional and
# unconditional one) as independent chains of CHAIN_WINDOWS windows side by side on CUDA. The estimator is a chain of
# ~350 dependent small kernels per Euler step whose cost grows with the rows of each, so two chains of 80 rows beat
# one of 160. Solve graph on an H200 (`profile_codec --chains`, W = 40 frames): 2 sessions 14.05 -> 12.68 ms,
# 4 sessions 17.34 -> 16.08; 1 session's two windows apart: no change (10.60 vs 10.66); 8 sessions slower
# (20.0 -> 21.0 with 2 chains, 22.6 with 8).
CHAIN_WINDOWS = 2
CHAIN_MAX_SESSIONS = 4


class _CFM(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.estimator = CausalConditionalDecoder(cfg)



class _PrefixLayout(NamedTuple):
    """A batch's prefix keys (prompt, then window) in one padded tensor: per session its prompt keys P[b] and window
    keys W[b]; positions pos [B, L] and validity valid [B, L] (host arrays)."""

    P: list[int]
    W: list[int]
    pos: np.ndarray
    valid: np.ndarray


def _stack_kv(kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """per layer (k, v) [B, T, H, dk] -> [B, layers, 2, T, H, dk], in one op."""
    return torch.stack([t for kv in kvs for t in kv], dim=1).unflatten(1, (len(kvs), 2))


class FlowModel(nn.Module):
    def __init__(self, cfg: FlowConfig, stream: StreamConfig) -> None:
        super().__init__()
        self.cfg, self.stream = cfg, stream
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg)
        self.encoder_proj = nn.Linear(cfg.d_model, cfg.output_size)
        self.decoder = _CFM(cfg)
        t = torch.linspace(0, 1, cfg.n_timesteps + 1, dtype=torch.float64)
        self.t_span = (1 - torch.cos(t * 0.5 * math.pi)).tolist()  # cosine schedule, host floats
        self.graphs = None  # EulerGraphs when CUDA graphs are enabled (CodecDecoder.load(cuda_graphs=True))
        self.enc_graphs = None  # EncoderGraphs, likewise
        self.solve_chains: int | None = None  # None: chains by the rule above; a number: that many (benchmarks)
        # A full chunk's solve in this many pieces (graphs) of consecutive Euler steps, with the caller's `between`
        # run after each: a caller that must be able to pause a round between pieces (the codec worker's rounds of
        # playing answers, which yield the GPU to new answers) sets it. Same steps, same result.
        self.solve_parts = 1
        # The encoder's float32 matmuls on TF32 tensor cores (CUDA; CodecDecoder.load(encoder_tf32=True)): set before
        # any encoder graph is captured.
        self.encoder_tf32 = False
        self._chain_streams = SideStreams()
        self._t_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # _step_times

    @property
    def device(self) -> torch.device:
        return self.input_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.input_embedding.weight.dtype

    # ---- voice -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def speaker(self, xvector: torch.Tensor) -> torch.Tensor:
        """xvector [spk_embed_dim] -> the projected speaker row [80] every estimator pass is conditioned on."""
        with float32_matmuls(False):
            return self.spk_embed_affine_layer(F.normalize(xvector.to(self.device, self.dtype)[None], dim=1))[0]

    @torch.inference_mode()
    def prepare_voice(self, codes: torch.Tensor, mel: torch.Tensor, xvector: torch.Tensor) -> PreparedVoice:
        """codes [P] long, mel [80, 4P], xvector [spk_embed_dim] -> cached encoder KV of the prompt and more."""
        dev, dt = self.device, self.dtype
        spks = self.speaker(xvector)
        P = int(codes.shape[0])
        r = self.cfg.token_mel_ratio
        if P == 0:
            z = torch.zeros(self.cfg.output_size, 0, device=dev, dtype=dt)
            return PreparedVoice(0, self._empty_kv(False), self._empty_kv(True), z, z, spks)
        la = self.cfg.pre_lookahead
        # The whole prompt as one chunk with no prefix keys and absent lookahead.
        codes = F.pad(codes.to(dev), (0, la))[None]  # [1, P + la]
        valid = torch.zeros(1, P + la, dtype=torch.bool, device=dev)
        valid[:, :P] = True
        cache = self.encoder.empty_cache(1, dev, dt)
        pos = torch.arange(P, device=dev)[None]
        up_pos = torch.arange(P * r, device=dev)[None]
        none = torch.zeros(1, 0, dtype=torch.long, device=dev)
        mu, _, _, kv, up_kv = self.encode(codes, valid, cache.pre, cache.up, pos, up_pos, self._empty_kv(False)[None],
                                          none, none, self._empty_kv(True)[None], none, none)
        return PreparedVoice(P, kv[0], up_kv[0], mu[0].contiguous(), mel.to(dev, dt), spks)

    def _empty_kv(self, up: bool) -> torch.Tensor:
        n = len(self.encoder.up_encoders if up else self.encoder.encoders)
        h = self.cfg.heads
        return torch.zeros(n, 2, 0, h, self.cfg.d_model // h, device=self.device, dtype=self.dtype)

    def _step_times(self, dev: torch.device, dt: torch.dtype) -> torch.Tensor:
        """The Euler steps' start times [steps, 1, 1] on `dev`, made once: a tensor from host floats is a synchronous
        copy, which in a new answer's stream setup (the engine loop's CreateResponse) waited for the loop's stream."""
        t = self._t_cache.get((dev, dt))
        if t is None:
            t = self._t_cache[(dev, dt)] = torch.tensor(self.t_span[:-1], dtype=dt).to(dev)[:, None, None]
        return t

    def new_state(self, voice: PreparedVoice, gen: torch.Generator) -> FlowState:
        cfg, C = self.cfg, self.stream.est_ctx_frames
        dev, dt = self.device, self.dtype
        cache = self.encoder.empty_cache(1, dev, dt)
        # Context of the first chunk: the prompt's last C frames on their ideal flow path toward the prompt
        # mel (left-padded with silence when the prompt is shorter).
        n_have = min(C, voice.mel.shape[1])
        target = torch.full((cfg.output_size, C), SILENCE_LOG_MEL, device=dev, dtype=dt)
        mu = torch.zeros(cfg.output_size, C, device=dev, dtype=dt)
        cond = torch.zeros(cfg.output_size, C, device=dev, dtype=dt)
        if n_have:
            target[:, C - n_have:] = voice.mel[:, -n_have:]
            mu[:, C - n_have:] = voice.mu[:, -n_have:]
            cond[:, C - n_have:] = voice.mel[:, -n_have:]
        z = torch.randn(cfg.output_size, C, generator=gen, device=dev, dtype=dt)
        t = self._step_times(dev, dt)  # [steps, 1, 1]
        traj = (1 - (1 - cfg.sigma_min) * t) * z + t * target  # [steps, 80, C]
        return FlowState(voice, cache.pre[0], cache.up[0], win_kv=self._empty_kv(False),
                         win_up_kv=self._empty_kv(True), ctx_traj=traj, ctx_mu=mu, ctx_cond=cond)

    # ---- one chunk for a batch of sessions ---------------------------------------------------------------
    @staticmethod
    def _runs(states: list[FlowState]) -> list[tuple[int, int]]:
        """Maximal runs [a, b) of consecutive states with the same voice and window lengths. A run's prompt keys, window
        keys and window update are one slice op each (not one op per session, ~25 us of host time apiece);
        CodecDecoder.run_jobs orders a batch so that such states are neighbours."""
        runs: list[tuple[int, int]] = []
        key = None
        for i, s in enumerate(states):
            k = s.run_key()
            if k != key:
                runs.append((i, i + 1))
                key = k
            else:
                runs[-1] = (runs[-1][0], i + 1)
        return runs

    def _prefix_layouts(self, states: list[FlowState]) -> tuple[_PrefixLayout, _PrefixLayout]:
        """`_prefix_layout` of the codes stack and of the up stack."""
        return self._prefix_layout(states, False), self._prefix_layout(states, True)

    def _prefix_layout(self, states: list[FlowState], up: bool) -> _PrefixLayout:
        """Where each session's prompt + window keys go in the padded prefix tensor (`_fill_prefixes`), and their
        positions and validity."""
        r = self.cfg.token_mel_ratio if up else 1
        P = [(s.voice.up_kv if up else s.voice.kv).shape[2] for s in states]
        W = [(s.win_up_kv if up else s.win_kv).shape[2] for s in states]
        first = [p + s.codes_done * r - w for p, w, s in zip(P, W, states, strict=True)]
        p, w, f = (np.asarray(a, dtype=np.int64)[:, None] for a in (P, W, first))
        i = np.arange(padded_prefix(int((p + w).max())), dtype=np.int64)[None]
        valid = i < p + w
        pos = np.where(valid, np.where(i < p, i, f + i - p), 0)  # prompt positions, then the window's
        return _PrefixLayout(P, W, pos, valid)

    @staticmethod
    def _fill_prefixes(X: torch.Tensor, states: list[FlowState], runs: list[tuple[int, int]], lay: _PrefixLayout,
                       up: bool) -> None:
        """Write every session's prompt + window keys/values into X [B, layers, 2, L, H, dk] as `lay` places them: a
        few ops per run of `_runs`, not per session or layer. Keys past a session's own are left as they are (they
        are masked)."""
        for a, b in runs:
            pa, wa = lay.P[a], lay.W[a]
            if pa:  # one voice: the same prompt keys in every row of the run
                X[a:b, :, :, :pa] = states[a].voice.up_kv if up else states[a].voice.kv
            if wa:
                wins = [s.win_up_kv if up else s.win_kv for s in states[a:b]]
                X[a:b, :, :, pa:pa + wa] = wins[0] if b - a == 1 else torch.stack(wins)

    def encode(self, codes: torch.Tensor, valid: torch.Tensor, pre: torch.Tensor, up: torch.Tensor, pos: torch.Tensor,
               up_pos: torch.Tensor, X: torch.Tensor, kpos: torch.Tensor, kvalid: torch.Tensor, upX: torch.Tensor,
               up_kpos: torch.Tensor, up_kvalid: torch.Tensor, blocked: torch.Tensor | None = None,
               up_blocked: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One chunk of n codes of every row through the encoder: the function EncoderGraphs replays (every input
        batch-first, rows independent, no host syncs), and the eager path.
        codes [B, n + la] long; valid [B, n + la] nonzero for real codes (absent lookahead is zeroed);
        pre [B, 2, D], up [B, 2 * ratio, D] the conv caches; pos [B, n], up_pos [B, n * ratio] positions;
        X [B, layers, 2, L, H, dk] prefix keys/values with positions kpos [B, L] and validity kvalid [B, L]
        (nonzero: a real key); upX, up_kpos, up_kvalid the same for the up stack. blocked [n, n], up_blocked
        [n * ratio, n * ratio] bool: pairs of the new codes (frames) that may not attend (several chunks in one call).
        Returns mu [B, 80, n * ratio], the new caches pre and up, and this chunk's keys/values
        [B, layers, 2, n, H, dk] and [B, up_layers, 2, n * ratio, H, dk]."""
        kvalid, up_kvalid = kvalid.bool(), up_kvalid.bool()
        prefixes = [KV(X[:, i, 0], X[:, i, 1], kpos, kvalid) for i in range(X.shape[1])]
        up_prefixes = [KV(upX[:, i, 0], upX[:, i, 1], up_kpos, up_kvalid) for i in range(upX.shape[1])]
        return self._encode(codes, valid, pre, up, pos, up_pos, prefixes, up_prefixes, blocked, up_blocked)

    def encode_rows(self, codes: torch.Tensor, valid: torch.Tensor, pre: torch.Tensor, up: torch.Tensor,
                    pos: torch.Tensor, up_pos: torch.Tensor, table: torch.Tensor, up_table: torch.Tensor,
                    factors: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
        """`encode` (CUDA) with each row's earlier keys read where its answer holds them: table, up_table [B, 6] int64
        (flow.state.key_table) of the two stacks; factors [positions, D] the key factors by position
        (conformer.key_factors); `chunk` codes a chunk (the new codes' chunk mask). A row's earlier keys are the
        positions before its first query's. Its shapes do not depend on how many keys the rows hold."""
        enc, r, tf32 = self.encoder, self.cfg.token_mel_ratio, self.encoder_tf32
        prefixes = [KeyRows(table, factors, chunk, tf32, i) for i in range(len(enc.encoders))]
        up_prefixes = [KeyRows(up_table, factors, chunk * r, tf32, i) for i in range(len(enc.up_encoders))]
        return self._encode(codes, valid, pre, up, pos, up_pos, prefixes, up_prefixes)

    def _encode(self, codes, valid, pre, up, pos, up_pos, prefixes, up_prefixes, blocked=None, up_blocked=None):
        with float32_matmuls(self.encoder_tf32):
            hid, cache, kvs, up_kvs = self.encoder.forward_chunk(
                self.input_embedding(codes), valid.bool(), EncoderCache(pre, up), pos, up_pos, prefixes, up_prefixes,
                blocked, up_blocked)
            mu = self.encoder_proj(hid).transpose(1, 2)  # [B, 80, F]
        return mu, cache.pre, cache.up, _stack_kv(kvs), _stack_kv(up_kvs)

    def encode_inputs(self, states: list[FlowState], codes: torch.Tensor, n: int, n_look: list[int],
                      runs: list[tuple[int, int]] | None = None,
                      lays: tuple[_PrefixLayout, _PrefixLayout] | None = None) -> EncodeInputs:
        """The arguments of `encode` for a chunk of n codes of every state (codes [B, n + pre_lookahead] long,
        lookahead slots beyond n_look[b] ignored), as new tensors. runs: `_runs(states)`, lays: `_prefix_layouts`,
        if the caller has them."""
        runs = runs if runs is not None else self._runs(states)
        lays = lays if lays is not None else self._prefix_layouts(states)
        B, s0, kw = len(states), states[0], {"device": self.device, "dtype": self.dtype}
        # [B, layers, 2, L, H, dk]: the prompt's keys' shape with the padded prefix length L of each stack
        X, upX = (torch.zeros(B, *kv.shape[:2], lay.pos.shape[1], *kv.shape[3:], **kw)
                  for kv, lay in ((s0.voice.kv, lays[0]), (s0.voice.up_kv, lays[1])))
        # Every index tensor of the chunk in one host -> device copy (from pinned memory: no stream sync).
        t_codes, t_valid, t_pos, t_up_pos, t_kpos, t_kvalid, t_up_kpos, t_up_kvalid = upload(
            self._index_arrays(states, codes, n, n_look, lays), self.device)
        args = EncodeInputs(t_codes, t_valid, torch.empty(B, *s0.pre.shape, **kw), torch.empty(B, *s0.up.shape, **kw),
                            t_pos, t_up_pos, X, t_kpos, t_kvalid, upX, t_up_kpos, t_up_kvalid)
        self._write_state(args, states, runs, lays)
        return args

    def _write_state(self, args: EncodeInputs, states: list[FlowState], runs: list[tuple[int, int]],
                     lays: tuple[_PrefixLayout, _PrefixLayout]) -> None:
        """The states' carried values into the first len(states) rows of `args`: the conv caches and every session's
        prompt + window keys, where `lays` places them."""
        B = len(states)
        torch.stack([s.pre for s in states], out=args.pre[:B])
        torch.stack([s.up for s in states], out=args.up[:B])
        self._fill_prefixes(args.X, states, runs, lays[0], False)
        self._fill_prefixes(args.upX, states, runs, lays[1], True)

    def _index_arrays(self, states: list[FlowState], codes: torch.Tensor, n: int, n_look: list[int],
                      lays: tuple[_PrefixLayout, _PrefixLayout]) -> list[np.ndarray]:
        """encode's index inputs as host arrays, in its order (codes, valid, pos, up_pos, kpos, kvalid, up_kpos,
        up_kvalid)."""
        la, r, B = self.cfg.pre_lookahead, self.cfg.token_mel_ratio, len(states)
        q0 = np.asarray([s.voice.n_codes + s.codes_done for s in states], dtype=np.int64)[:, None]  # [B, 1]
        valid = np.concatenate([np.ones((B, n), dtype=bool), np.arange(la)[None] < np.asarray(n_look)[:, None]], 1)
        return [codes.cpu().numpy(), valid, q0 + np.arange(n)[None], q0 * r + np.arange(n * r)[None],
                lays[0].pos, lays[0].valid, lays[1].pos, lays[1].valid]

    def _encode_in_place(self, states: list[FlowState], codes: torch.Tensor, n: int, n_look: list[int],
                         runs: list[tuple[int, int]], lays: tuple[_PrefixLayout, _PrefixLayout]
                         ) -> tuple[EncodeInputs, tuple[torch.Tensor, ...]] | None:
        """A full chunk through the encoder graph captured for its shapes, its inputs written straight into the
        graph's buffers (EncoderGraphs.buffers): the inputs (the graph's, batch-padded) and encode's outputs. None
        when no graph is captured for these shapes (the caller builds the inputs and runs `enc_graphs.run`)."""
        got = self.enc_graphs.buffers(len(states), lays[0].pos.shape[1], lays[1].pos.shape[1])
        if got is None:
            return None
        key, bufs, host = got
        args, B = EncodeInputs(*bufs), len(states)
        for dst, a in zip(host, self._index_arrays(states, codes, n, n_look, lays), strict=True):
            dst[:B] = a
        self._write_state(args, states, runs, lays)
        return args, self.enc_graphs.replay_staged(key, B)

    @torch.inference_mode()
    def decode_chunk(self, states: list[FlowState], codes: torch.Tensor, n: int, n_look: list[int],
                     gens: list[torch.Generator], between: Callable[[], None] | None = None) -> torch.Tensor:
        """codes [B, n + pre_lookahead] long (lookahead slots beyond n_look[b] are ignored).
        Returns mel [B, 80, n * ratio] and advances every state. `between` is called after the encoder's and each
        solve piece's work is queued (see `solve_parts`)."""
        st, r = self.stream, self.cfg.token_mel_ratio
        runs, lays = self._runs(states), self._prefix_layouts(states)
        full = self.enc_graphs is not None and n == st.chunk_codes  # (enc_graphs is only set on CUDA devices)
        done = self._encode_in_place(states, codes, n, n_look, runs, lays) if full else None
        if done is not None:
            args, (mu, pre, up, new_kv, new_up_kv) = done
        else:
            args = self.encode_inputs(states, codes, n, n_look, runs, lays)
            # a first use of these shapes (captured now, or eager once capture_steady_state has run), a last partial
            # chunk (once per answer), or no CUDA graphs
            run = self.enc_graphs.run if full else self.encode
            mu, pre, up, new_kv, new_up_kv = run(*args)
        Fr = n * r
        # Keep at most `enc_left_chunks` chunks of this session's own keys: per run of `_runs`, its windows (as copied
        # into the prefix tensors X, upX) and the new keys in one op; each session keeps a view of its row.
        keep, keep_up = st.enc_left_chunks * st.chunk_codes, st.enc_left_chunks * st.chunk_codes * r
        X, upX = args.X, args.upX
        for a, b in runs:
            wins = self._windows(X[a:b], new_kv[a:b], states[a].voice.kv.shape[2], states[a].win_kv.shape[2], keep)
            up_wins = self._windows(upX[a:b], new_up_kv[a:b], states[a].voice.up_kv.shape[2],
                                    states[a].win_up_kv.shape[2], keep_up)
            for i, s in enumerate(states[a:b]):
                s.win_kv, s.win_up_kv = wins[i], up_wins[i]
        for b, s in enumerate(states):
            s.pre, s.up = pre[b], up[b]
            s.codes_done += n
        if between is not None:
            between()
        return self._solve(states, mu, Fr, gens, between)

    @staticmethod
    def _windows(X: torch.Tensor, new: torch.Tensor, p: int, w: int, keep: int) -> torch.Tensor:
        """The next windows of a run: the last `keep` keys of its window (X's keys p..p+w, X [n, layers, 2, L, H, dk])
        followed by the chunk's new keys [n, layers, 2, T, H, dk]."""
        if w == 0:
            return new[:, :, :, -keep:]
        return torch.cat([X[:, :, :, p:p + w], new], dim=3)[:, :, :, -keep:]

    def step_ranges(self, frames: int) -> list[tuple[int, int]]:
        """The Euler steps of each piece of a solve of `frames` new frames: `solve_parts` pieces for a full chunk,
        one for a last partial chunk (once per answer: not worth graphs of its own per piece)."""
        steps, k = self.cfg.n_timesteps, self.solve_parts
        if k <= 1 or frames != self.stream.chunk_codes * self.cfg.token_mel_ratio:
            return [(0, steps)]
        k = min(k, steps)
        bounds = [steps * i // k for i in range(k + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def _solve(self, states: list[FlowState], mu: torch.Tensor, Fr: int, gens: list[torch.Generator],
               between: Callable[[], None] | None = None) -> torch.Tensor:
        cfg, C = self.cfg, self.stream.est_ctx_frames
        dev, dt = self.device, self.dtype
        B = len(states)
        z = torch.stack([torch.randn(cfg.output_size, Fr, generator=g, device=dev, dtype=dt) for g in gens])
        ctx_traj = torch.stack([s.ctx_traj for s in states])  # [B, steps, 80, C]
        mu_w = torch.cat([torch.stack([s.ctx_mu for s in states]), mu], dim=2)
        cond_w = torch.cat([torch.stack([s.ctx_cond for s in states]),
                            torch.zeros(B, cfg.output_size, Fr, device=dev, dtype=dt)], dim=2)
        spks = torch.stack([s.voice.spks for s in states])
        x, trajs = z, []
        for s0, s1 in self.step_ranges(Fr):
            if self.graphs is not None and dev.type == "cuda":
                x, part = self.graphs.run(x, ctx_traj, mu_w, cond_w, spks, steps=(s0, s1))
            else:
                x, part = self.euler(x, ctx_traj, mu_w, cond_w, spks, s0, s1)
            trajs.append(part)
            if between is not None:
                between()
        traj_t = torch.cat(trajs, dim=1) if len(trajs) > 1 else trajs[0]  # [B, steps, 80, F]
        full_traj = torch.cat([ctx_traj, traj_t], dim=3)[..., -C:]
        full_mu, full_cond = mu_w[..., -C:], cond_w[..., -C:]
        for b, s in enumerate(states):
            s.ctx_traj, s.ctx_mu, s.ctx_cond = full_traj[b], full_mu[b], full_cond[b]
        return x

    def _estimate(self, est: CausalConditionalDecoder, h: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
                  ) -> torch.Tensor:
        """est.run(h, rows, mask) for h [2B, 320, W], its windows split into chains run side by side on CUDA: every
        window (a session's conditional or unconditional one) is independent of the others through the estimator."""
        n = h.shape[0]
        k = self.solve_chains
        if k is None:
            k = n // CHAIN_WINDOWS if 2 <= n // 2 <= CHAIN_MAX_SESSIONS else 1
        if not h.is_cuda or k <= 1 or n % k:
            return est.run(h, rows, mask)
        g = n // k
        parts = side_by_side(self._chain_streams.get(h.device, k - 1),
                             *(lambda i=i: est.run(h[i * g:(i + 1) * g], rows, mask, windows=n) for i in range(k)))
        return torch.cat(parts)

    def euler(self, z: torch.Tensor, ctx_traj: torch.Tensor, mu_w: torch.Tensor, cond_w: torch.Tensor,
              spks: torch.Tensor, s0: int = 0, s1: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Integrate the new frames over Euler steps s0..s1 (default all): z [B, 80, F] their x at step s0 (the noise
        at 0); ctx_traj [B, steps, 80, C]; mu_w, cond_w [B, 80, C + F]; spks [B, 80]. Returns x at step s1 (the mel
        at the last) [B, 80, F] and the new frames' x_t at steps s0..s1-1 [B, s1 - s0, 80, F]."""
        cfg, C = self.cfg, self.stream.est_ctx_frames
        B, W, dev, dt = z.shape[0], mu_w.shape[2], z.device, z.dtype
        est = self.decoder.estimator
        edt = est.final_proj.weight.dtype
        table = est.time_table(self.t_span, dt)  # [steps, n_resnets, 1, C]: the time conditioning of every step
        # Context frames attend only to context; new frames attend to everything in the window.
        mask = window_mask(W, C, dev, edt)
        # The estimator input cat(x, mu, spks, cond) for [conditional; unconditional] rows: only x changes per step,
        # so the rest is written once. The unconditional half has no mu, speaker or cond.
        n = cfg.output_size
        # Time-major memory [2, B, W, 4n] (the estimator's layout: its first convs read it without a copy).
        mem = torch.zeros(2, B, W, 4 * n, device=dev, dtype=edt)
        hv = mem.transpose(2, 3)  # [2, B, 4n, W] view
        hv[0, :, n:2 * n] = mu_w
        hv[0, :, 2 * n:3 * n] = spks[:, :, None]
        hv[0, :, 3 * n:] = cond_w
        x_in = hv[:, :, :n]  # [2, B, 80, W] view
        h = mem.view(2 * B, W, 4 * n).transpose(1, 2)  # [2B, 4n, W] view
        x = z  # the ODE state stays in the flow dtype (float32); the estimator may run in bf16
        traj = []
        for s in range(s0, cfg.n_timesteps if s1 is None else s1):
            t0, t1 = self.t_span[s], self.t_span[s + 1]
            traj.append(x)
            x_in[:, :, :, :C] = ctx_traj[:, s]
            x_in[:, :, :, C:] = x
            v = self._estimate(est, h, table[s], mask)[:, :, C:]  # [2B, 80, F]
            # x += dt * ((1 + r) v_cond - r v_uncond), as two fused multiply-adds in the flow dtype.
            x = torch.add(x, v[:B], alpha=(t1 - t0) * (1.0 + cfg.cfg_rate))
            x = torch.add(x, v[B:], alpha=-(t1 - t0) * cfg.cfg_rate)
        return x, torch.stack(traj, dim=1)
