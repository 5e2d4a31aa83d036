"""The engine: one step is schedule -> run -> sample -> emit.

Callers add requests (rows of the token grid), feed more input to live ones, abort them, and
call `step()` in a loop; each step returns at most one new row per running request.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engines.api import EngineStats, InvalidRequestError, SamplingParams, StepOutput, step_row_bucket
from engines.config import EngineConfig, ModelConfig, model_config_for
from engines.lm.kv.sizing import fit_kv_cache_bytes
from engines.lm.loader.checkpoint import load_model, random_model
from engines.lm.model import fp8_copies
from engines.lm.runner import ModelRunner, PendingTokens
from engines.lm.scheduler import ScheduledChunk, Scheduler
from engines.lm.sequence import Sequence
from engines.tokens import MODALITY_PAD, TEXT_STOP_TOKENS, Row


def _check_rows(rows: Seq[Row] | torch.Tensor, mc: ModelConfig) -> list[Row]:
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 2 or rows.shape[1] != 2:
            raise InvalidRequestError(f"rows must have shape [L, 2], got {tuple(rows.shape)}")
        rows = rows.tolist()
    out = []
    for i, r in enumerate(rows):
        try:
            t, a = int(r[0]), int(r[1])
        except (TypeError, ValueError, IndexError):
            raise InvalidRequestError(f"row {i} is not a (text, audio) pair: {r!r}") from None
        if not (0 <= t < mc.vocab_size and 0 <= a < mc.audio_vocab_size):
            raise InvalidRequestError(
                f"row {i} = ({t}, {a}) outside vocabularies (text < {mc.vocab_size}, audio < {mc.audio_vocab_size})")
        out.append((t, a))
    return out


@dataclass
class _Launched:
    """A step on the device whose tokens the host has not read yet."""

    chunks: list[ScheduledChunk]
    tokens: PendingTokens
    ahead: bool  # launched before the previous step's tokens were read (Scheduler.schedule_ahead)
    decodes: int = 0  # with ahead: its first chunks, decode rows whose inputs are the previous step's samples


class Engine:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig, seed: int = 0):
        self.model_config = model_config
        self.config = config
        num_blocks = config.num_blocks(model_config)
        self.scheduler = Scheduler(config, num_blocks)
        self.runner = ModelRunner(model, model_config, config, num_blocks)
        self._rng = random.Random(seed)
        self._stats = EngineStats(total_blocks=num_blocks)
        self._inflight: _Launched | None = None
        self._tokens_read_at: float | None = None  # when the last step's tokens were read, if work was left

    @classmethod
    def from_name(cls, name_or_path: str, config: EngineConfig, seed: int = 0) -> Engine:
        """`tiny-random` / `full-random` build random weights on the device; anything else is a checkpoint dir."""
        model, mc = cls.load_weights(name_or_path, config, seed)
        return cls.build(model, mc, config, seed)

    @staticmethod
    def load_weights(name_or_path: str, config: EngineConfig, seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
        """The model on `config`'s device and dtype (random for the presets) and its config."""
        mc = model_config_for(name_or_path)
        if name_or_path in ("tiny-random", "full-random"):
            model = random_model(mc, device=config.device, dtype=config.torch_dtype, seed=seed)
        else:
            model = load_model(name_or_path, device=config.device, dtype=config.torch_dtype)
        if config.fp8_weights:
            fp8_copies.apply(model, keep_weights=not config.fp8_only)
        return model, mc

    @classmethod
    def build(cls, model: torch.nn.Module, mc: ModelConfig, config: EngineConfig, seed: int = 0,
              kv_free_bytes: int | None = None) -> Engine:
        """The engine around loaded weights. `kv_free_bytes`: the device's free memory; the KV pool then takes it less
        a headroom (engines.lm.kv.sizing) instead of `config.kv_cache_bytes`."""
        if kv_free_bytes is not None:
            config = dataclasses.replace(config, kv_cache_bytes=fit_kv_cache_bytes(kv_free_bytes, config, mc))
        return cls(model, mc, config, seed=seed)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, rows: Seq[Row] | torch.Tensor, params: SamplingParams | None = None,
                    conversation_id: str | None = None, input_done: bool = True, background: bool = False,
                    refill_rows: int = 0, ramp_rows: int | None = None) -> None:
        """`background`: a request of its own (no conversation) that runs only on what other work leaves
        (Scheduler); `refill_rows`: the first rows of `rows` re-run history cut to fit, as background work;
        `ramp_rows`: the answer's first rows its first audio waits on (default EngineConfig.ramp_rows)."""
        params = params or SamplingParams()
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        self.scheduler.add(request_id, _check_rows(rows, self.model_config), params, seed, conversation_id,
                           input_done, background=background, refill_rows=refill_rows, ramp_rows=ramp_rows)

    def append_input(self, request_id: str, rows: Seq[Row] | torch.Tensor, input_done: bool = True,
                     params: SamplingParams | None = None, ramp_rows: int | None = None) -> None:
        """More rows for a request whose input is open; `params` (optional) replaces its sampling settings;
        `ramp_rows` as add_request's."""
        self.scheduler.append_input(request_id, _check_rows(rows, self.model_config), input_done, params,
                                    params.seed if params is not None else None, ramp_rows)

    def rewrite_input(self, request_id: str, start: int, rows: Seq[Row] | torch.Tensor) -> int:
        """Rows from `start` (of the request's whole history) replaced by `rows`, for a request that has generated
        nothing: its KV is computed again from there by the next steps. Returns the rows whose KV is to be computed
        again (0 when none was computed yet)."""
        redone = self.scheduler.rewrite_input(request_id, start, _check_rows(rows, self.model_config))
        for c in self._inflight.chunks if self._inflight is not None else []:  # dropped when read (ahead_row_holds)
            c.stale = c.stale or (c.seq.request_id == request_id and c.start + c.num_rows > start)
        return redone

    def abort(self, request_id: str) -> bool:
        """Takes effect at the next step, which emits a finished output with reason "abort"."""
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------------

    def step(self, on_wait: Callable[[], bool] | None = None) -> list[StepOutput]:
        """Emits one step's rows. While every sequence decodes audio, or while a new answer ramps beside other
        sequences' prefill (Scheduler.schedule_ahead), the next step is launched before this one's tokens are read
        (its decode input rows stay on the device), so the GPU never idles on the host.
        `on_wait`: called again and again while the GPU runs the step, until it returns False (PendingTokens.get);
        it must not change the engine's requests."""
        outputs: list[StepOutput] = []
        launched, self._inflight = self._inflight, None
        if launched is None:
            sched = self.scheduler.schedule()
            outputs = [StepOutput(s.request_id, -1, -1, s.mode, True, s.finish_reason) for s in sched.finished]
            if not sched.chunks:
                return outputs
            launched = self._launch(sched.chunks, None)
        if self.config.overlap:
            ahead = self.scheduler.schedule_ahead(launched.chunks)
            if ahead is not None:
                self._inflight = self._launch(ahead, launched, self.scheduler.ahead_ending)
                self._stats.overlapped_steps += 1
            elif (why := self.scheduler.ahead_refusal) is not None:
                self._count_refusal(why, launched.chunks)
        return outputs + self._emit(launched, on_wait)

    def _count_refusal(self, why: str, chunks: list[ScheduledChunk]) -> None:
        st = self._stats
        st.ahead_refused[why] = st.ahead_refused.get(why, 0) + 1
        if self.scheduler.ramps_after(chunks):
            st.ahead_refused_ramping[why] = st.ahead_refused_ramping.get(why, 0) + 1

    def _launch(self, chunks: list[ScheduledChunk], after: _Launched | None, skip: Seq[int] = ()) -> _Launched:
        """`after`: the step in flight whose samples are this one's leading decode rows' inputs, but for the
        samples in `skip` (Scheduler.ahead_ending)."""
        if after is None and self._tokens_read_at is not None:
            self._stats.launch_gaps += 1
            self._stats.launch_gap_s += time.perf_counter() - self._tokens_read_at
        self._tokens_read_at = None
        t0 = time.perf_counter()
        codes = None
        if after is not None:
            codes = after.tokens.audio_codes()  # [R]: one per sampled chunk of `after`, in order
            if skip:
                left_out = set(skip)
                codes = self.runner.gather(codes, [i for i in range(codes.shape[0]) if i not in left_out])
        tokens = self.runner.run(chunks, codes)
        self._stats.steps += 1
        rows = sum(c.num_rows for c in chunks)
        bucket = step_row_bucket(rows)
        self._stats.step_row_counts[bucket] += 1
        self._stats.step_row_sums[bucket] += rows
        self._stats.launch_s += time.perf_counter() - t0
        return _Launched(chunks, tokens, codes is not None, 0 if codes is None else int(codes.shape[0]))

    def _emit(self, launched: _Launched, on_wait: Callable[[], bool] | None = None) -> list[StepOutput]:
        chunks, tokens = launched.chunks, launched.tokens.get(on_wait)
        read_at = time.perf_counter()
        if launched.ahead:
            # Keep the rows whose assumption held; the others are run again by a normal step (a sequence
            # aborted since the launch gets no more rows, as if this step had not started yet).
            holds = [self.scheduler.ahead_row_holds(c, i < launched.decodes) for i, c in enumerate(chunks)]
            sampled_holds = [h for h, c in zip(holds, chunks, strict=True) if c.needs_logits]
            tokens = [t for t, ok in zip(tokens, sampled_holds, strict=True) if ok]
            chunks = [c for c, ok in zip(chunks, holds, strict=True) if ok]
        for c in chunks:
            c.seq.num_computed += c.num_rows
            if c.seq.num_generated:
                self._stats.decoded_rows += c.num_rows
            else:
                self._stats.prefilled_rows += c.num_rows
        outputs = []
        sampled = [c.seq for c in chunks if c.needs_logits]
        for seq, (text, audio) in zip(sampled, tokens, strict=True):
            if seq.num_generated == 0:
                seq.start()
            mode = seq.mode
            if mode == "audio":
                text = MODALITY_PAD
            seq.rows.append((text, audio))
            seq.num_generated += 1
            if text in TEXT_STOP_TOKENS:
                seq.finish_reason = "stop"
            elif seq.num_generated >= seq.params.max_new_tokens:
                seq.finish_reason = "length"
            else:
                seq.update_mode()
            outputs.append(StepOutput(seq.request_id, text, audio, mode, seq.finish_reason is not None,
                                      seq.finish_reason))
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
        if self._inflight is None and self.scheduler.has_work():
            self._tokens_read_at = read_at
        return outputs

    # ---- conversations and introspection -------------------------------------------------

    def conversation_rows(self, conversation_id: str) -> int:
        conv = self.scheduler.conversations.get(conversation_id)
        return len(conv.rows) if conv else 0

    def conversation_unrun_rows(self, conversation_id: str) -> int:
        """History rows without KV yet (an answer's last sampled row): the next turn prefills them too."""
        conv = self.scheduler.conversations.get(conversation_id)
        return len(conv.rows) - conv.num_computed if conv else 0

    def conversation_history(self, conversation_id: str) -> list[Row]:
        conv = self.scheduler.conversations.get(conversation_id)
        return list(conv.rows) if conv else []

    def truncate_conversation(self, conversation_id: str, num_rows: int) -> None:
        self.scheduler.truncate_conversation(conversation_id, num_rows)

    def release_conversation(self, conversation_id: str) -> None:
        self.scheduler.release_conversation(conversation_id)

    def live_request(self, request_id: str) -> Sequence | None:
        return self.scheduler.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted but background ones (what the service loop reads every step to know whether an
        answer waits, without `stats()`'s copy)."""
        waiting = self.scheduler.waiting
        return len(waiting) - sum(1 for s in waiting if s.background_request) if waiting else 0

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.free_blocks = self.scheduler.pool.num_free
        # The caller keeps a copy, its lists too. (Not copy.deepcopy: the service loop reads stats() every step,
        # and a deep copy took ~27 us against ~5 for this.)
        return dataclasses.replace(s, step_row_counts=list(s.step_row_counts), step_row_sums=list(s.step_row_sums),
                                   ahead_refused=dict(s.ahead_refused),
                                   ahead_refused_ramping=dict(s.ahead_refused_ramping))

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
