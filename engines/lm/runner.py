"""Model runner: turns scheduled chunks into one forward pass over the paged cache, then samples.

It owns the device state: the KV cache tensor, and per-slot "seen" masks holding each running
sequence's token history for the repetition penalty (updated on the device as rows are run, so
sampling never walks the history on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engines.config import EngineConfig, ModelConfig
from engines.kernels.tiles import tile_map
from engines.lm.model import fp8_copies
from engines.lm.model.batch import ForwardBatch
from engines.lm.sampler import TEXT_CHANNEL, ChannelColumns, ChannelTensors, sample_audio, sample_rows
from engines.lm.scheduler import ScheduledChunk
from engines.lm.sequence import Sequence
from engines.lm.step_graphs import CudaGraphDecoder, CudaGraphMixed, private_stream
from engines.tokens import MODALITY_PAD, Row


def _float_words(floats: list[list[float]]) -> list[int]:
    """Float32 columns as int64 words (two floats per word, little-endian), to travel in an int64 upload; the
    device side views them back as float32. The number of floats must be even."""
    return np.asarray(floats, dtype=np.float32).reshape(-1).view(np.int64).tolist()


def _flat_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """The chunks' new rows as flat (text, audio) words, in batch order: [2 T]."""
    return [x for c in chunks for row in c.seq.rows[c.start:c.start + c.num_rows] for x in row]


def _ahead_rows(device_audio: torch.Tensor | None) -> int:
    """The leading decode chunks of a step launched ahead: one per audio code already on the device."""
    return 0 if device_audio is None else int(device_audio.shape[0])


def _step_rows(chunks: list[ScheduledChunk], k: int) -> list[int]:
    """_flat_rows, where the first k chunks are one-row decodes whose rows (modality pad, code) are not on the host
    yet: their codes are staged as 0 and copied in on the device."""
    return [MODALITY_PAD, 0] * k + _flat_rows(chunks[k:])


class PendingTokens:
    """A launched step's sampled (text, audio) pairs: on the device at once, on the host when read.

    The device-to-host copy is queued behind the step, so reading waits for this step only, while a
    step launched after it keeps the GPU busy.
    """

    def __init__(self, pairs: torch.Tensor) -> None:
        self.device_pairs = pairs  # [R, 2] int64
        self._event = None
        if pairs.is_cuda:
            self._host = torch.empty(pairs.shape, dtype=pairs.dtype, pin_memory=True)
            self._host.copy_(pairs, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = pairs

    def get(self, on_wait: Callable[[], bool] | None = None) -> list[Row]:
        """The rows, once the step is done. `on_wait`: called while it is not, until it returns False (it sleeps
        between calls itself); the host work other threads hand over is then not held up for a whole step."""
        if self._event is not None:
            while on_wait is not None and not self._event.query() and on_wait():
                pass
            self._event.synchronize()
        return [(t, a) for t, a in self._host.tolist()]

    def audio_codes(self) -> torch.Tensor:
        """The sampled audio codes [R] on the device: the rows (modality pad, code) audio-mode sequences feed back."""
        return self.device_pairs[:, 1]


@dataclass
class StepSampling:
    """The sampling parameters of one step's rows that need a sample, on the device in two uploads."""

    seqs: list[Sequence]
    ints: torch.Tensor  # [8, R] int64: slot, seed, step, min_new_tokens, audio top_k, greedy, text top_k, greedy
    floats: torch.Tensor  # [6, R] float32: audio temperature, top_p, penalty, then the text channel's
    audio_max_top_k: int
    text_max_top_k: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig, num_blocks: int):
        self.model = model
        self.mc = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        # One block past the pool: padding rows of CUDA-graph batches write there.
        self.pad_block = num_blocks
        self.kv_cache = torch.zeros(
            model_config.num_attention_layers, 2, num_blocks + 1, config.block_size,
            model_config.num_key_value_heads, model_config.head_dim, dtype=config.kv_torch_dtype, device=self.device,
        )  # [layers, k/v, blocks, block_size, kv_heads, head_dim]
        # One row per running slot, and a spare row that the padding rows of decode graphs mark.
        self.spare_slot = config.max_running
        self.text_seen = torch.zeros(config.max_running + 1, model_config.vocab_size, dtype=torch.bool,
                                     device=self.device)
        self.audio_seen = torch.zeros(config.max_running + 1, model_config.audio_vocab_size, dtype=torch.bool,
                                      device=self.device)
        # The value written by the history updates, on the device: a Python `True` would be copied from pageable
        # host memory on every step, and such a copy waits for the whole stream (no step could be launched ahead).
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self.graphs = self.mixed_graphs = None
        if self.device.type == "cuda":
            # The text tail's stream (MossSpeechModel.forward): private, as it runs cuBLAS GEMMs inside the graphs.
            model.tail_stream = private_stream(self.device)
            # fp8 copies (if any): their GEMMs tuned for every row count a step can bring, before the graphs
            fp8_copies.tune_kernels(model, config.prefill_token_budget, config.max_running)
        if self.device.type == "cuda" and config.cuda_graphs:
            max_blocks = -(-config.max_model_len // config.block_size)
            self.graphs = CudaGraphDecoder(model, self.kv_cache, config.max_running, max_blocks, self.pad_block,
                                           mark_history=self._mark_history, spare_slot=self.spare_slot)
            self.graphs.capture()
            self.mixed_graphs = CudaGraphMixed(model, self.kv_cache, config.prefill_token_budget, config.max_running,
                                               max_blocks, self.pad_block, self.graphs.pool)
            self.mixed_graphs.capture_all()
            with torch.inference_mode():  # the text head runs outside the graphs: tune its GEMM now, not mid-answer
                model.text_logits(torch.zeros(1, model_config.hidden_size, device=self.device, dtype=self.dtype))

    # ---- run -----------------------------------------------------------------------------

    def _columns(self, chunks: list[ScheduledChunk]
                 ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]], list[int]]:
        """Host columns of the chunks: per row (position, KV slot), per sequence (query start, context length, block
        table) and the flat indices of the rows whose logits are needed."""
        bs = self.block_size
        positions, slots, qstart, ctx, tables, logits_rows = [], [], [0], [], [], []
        for c in chunks:
            seq = c.seq
            end = c.start + c.num_rows
            for p in range(c.start, end):
                positions.append(p)
                slots.append(seq.block_ids[p // bs] * bs + p % bs)
            qstart.append(qstart[-1] + c.num_rows)
            ctx.append(end)
            tables.append(seq.block_ids[: -(-end // bs)])
            if c.needs_logits:
                logits_rows.append(qstart[-1] - 1)
        return positions, slots, qstart, ctx, tables, logits_rows

    def build_batch(self, chunks: list[ScheduledChunk], device_audio: torch.Tensor | None = None) -> ForwardBatch:
        """device_audio: the codes [k] of the first k chunks' rows, already on the device (`run`)."""
        positions, slots, qstart, ctx, tables, logits_rows = self._columns(chunks)
        k = _ahead_rows(device_audio)
        rows = _step_rows(chunks, k)
        width = max(len(t) for t in tables)
        num_decode = 0
        while num_decode < len(chunks) and chunks[num_decode].num_rows == 1:
            num_decode += 1
        t, b = len(positions), len(chunks)
        flat = rows + positions + slots + qstart + ctx + logits_rows
        for tbl in tables:
            flat += tbl + [0] * (width - len(tbl))
        n_tiles = 0
        if num_decode < b and self.device.type == "cuda":
            seqs, firsts = tile_map([c.num_rows for c in chunks], num_decode)
            n_tiles = len(seqs)
            flat += seqs + firsts
        buf = self._upload(torch.tensor(flat, dtype=torch.long))
        sizes = [len(rows), t, t, b + 1, b, len(logits_rows), b * width, 2 * n_tiles]
        r, pos, slot, qs, cl, lr, bt, tiles = torch.split(buf, sizes)
        if k:
            r.view(t, 2)[:k, 1].copy_(device_audio)
        return ForwardBatch(
            rows=r.view(t, 2),
            positions=pos, slot_mapping=slot, query_start=qs, context_lens=cl,
            block_tables=bt.view(b, width), logits_rows=lr,
            max_query_len=max(c.num_rows for c in chunks),
            max_context_len=max(ctx),
            is_decode=num_decode == len(chunks),
            num_decode_seqs=num_decode,
            query_start_host=qstart,
            context_lens_host=ctx,
            tiles=tiles.view(2, n_tiles) if n_tiles else None,
        )

    def gather(self, values: torch.Tensor, index: list[int]) -> torch.Tensor:
        """values[index] for values on the device, without waiting for the work that makes them."""
        return values.index_select(0, self._upload(torch.tensor(index, dtype=torch.long)))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """One host-to-device copy from pinned memory: no stream sync, unlike a copy from pageable memory."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _init_histories(self, chunks: list[ScheduledChunk]) -> None:
        """On a sequence's first run, its slot's history is reset to the rows cached before this step."""
        for c in chunks:
            seq = c.seq
            if not seq.history_marked:
                self.text_seen[seq.slot].zero_()
                self.audio_seen[seq.slot].zero_()
                if c.start > 0:
                    hist = self._upload(torch.tensor(seq.rows[: c.start], dtype=torch.long))
                    self._mark_history(hist, torch.full((c.start,), seq.slot, dtype=torch.long, device=self.device))
                seq.history_marked = True

    def _mark_history(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Add rows [T, 2] to the histories of their slots [T] (inside the decode graphs, or before an eager step)."""
        self.text_seen.index_put_((slots, rows[:, 0]), self._true)
        self.audio_seen.index_put_((slots, rows[:, 1]), self._true)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], device_audio: torch.Tensor | None = None) -> PendingTokens:
        """One step: the forward pass over the chunks, then a (text, audio) pair per chunk that needs logits, in
        chunk order. device_audio: for a step launched before its input rows were read, the audio codes [k] on the
        device of its first k chunks, one-row audio-mode decodes (each row is (modality pad, code)) whose sequences
        will have generated one row more by then; the other chunks' rows are on the host."""
        self._init_histories(chunks)
        seqs = [c.seq for c in chunks if c.needs_logits]
        graph = self.graphs is not None and all(c.num_rows == 1 for c in chunks) and self.graphs.bucket(
            len(chunks)) is not None
        if graph:
            hidden, audio_logits, sampling = self._replay_decode(chunks, seqs, device_audio)
        else:
            batch = self.build_batch(chunks, device_audio)
            slot_of_row = [c.seq.slot for c in chunks for _ in range(c.num_rows)]
            self._mark_history(batch.rows, self._upload(torch.tensor(slot_of_row, dtype=torch.long)))
            sampling = self._sampling(seqs, _ahead_rows(device_audio)) if seqs else None
            hidden, audio_logits = self._forward(batch)
        if sampling is None:
            return PendingTokens(torch.zeros(0, 2, dtype=torch.long))
        return self._sample(sampling, hidden, audio_logits)

    def _replay_decode(self, chunks: list[ScheduledChunk], seqs: list[Sequence], device_audio: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, StepSampling | None]:
        """A one-row-per-sequence step through the decode graphs: its inputs, sampling columns and logits rows go to
        the device in one copy (engines/lm/step_graphs.py), the history update runs inside the graph."""
        positions, slots, _, ctx, tables, logits_rows = self._columns(chunks)
        k = _ahead_rows(device_audio)
        rows = _step_rows(chunks, k)
        n, r = len(chunks), len(seqs)
        extra = []
        if seqs:
            cols = self._sampling_columns(seqs, k)
            extra = [x for col in cols[0] for x in col] + _float_words(cols[1])
        select = r != n  # 1-row prefill chunks of open inputs: no sample
        if select:
            extra += logits_rows
        dev = self.graphs.stage(rows, positions, slots, ctx, [c.seq.slot for c in chunks], tables, extra)
        if device_audio is not None:
            self.graphs.set_audio_codes(device_audio)
        hidden, audio_logits = self.graphs.replay_staged(n)
        if select:
            lr = dev[-r:] if r else dev[:0]
            hidden, audio_logits = hidden[:, lr], audio_logits[lr]
        if not seqs:
            return hidden, audio_logits, None
        ints = dev[: 8 * r].view(8, r)
        floats = dev[8 * r: 11 * r].view(torch.float32).view(6, r)
        return hidden, audio_logits, StepSampling(seqs, ints, floats, cols[2], cols[3])

    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step with prefill rows (or a decode step no graph fits): hidden states [2, R, hidden] (text tail, audio
        tail) at the logits rows; audio logits when a mixed-step graph ran."""
        if self.mixed_graphs is not None and not batch.is_decode and self.mixed_graphs.key(
                batch.num_rows, batch.num_seqs) is not None:
            return self.mixed_graphs.replay(batch)
        return self.model(batch, self.kv_cache), None

    # ---- sample --------------------------------------------------------------------------

    @staticmethod
    def _sampling_columns(seqs: list[Sequence], ahead: int
                          ) -> tuple[list[list[int]], list[list[float]], int, int]:
        """StepSampling's ints [8][R] and floats [6][R] on the host, and the audio and text top-k widths. The first
        `ahead` sequences sample the row after the one in flight (a step launched ahead)."""
        greedy = [s.params.greedy for s in seqs]
        audio_cols = ChannelColumns.of([s.params.audio for s in seqs], greedy)
        text_cols = ChannelColumns.of([s.params.text for s in seqs], greedy)
        steps = [s.num_generated + (i < ahead) for i, s in enumerate(seqs)]
        ints = [[s.slot for s in seqs], [s.seed for s in seqs], steps,
                [s.params.min_new_tokens for s in seqs]] + audio_cols.ints + text_cols.ints
        return ints, audio_cols.floats + text_cols.floats, audio_cols.max_top_k, text_cols.max_top_k

    def _sampling(self, seqs: list[Sequence], ahead: int) -> StepSampling:
        ints, floats, audio_k, text_k = self._sampling_columns(seqs, ahead)
        return StepSampling(seqs, self._upload(torch.tensor(ints, dtype=torch.long)),
                            self._upload(torch.tensor(floats, dtype=torch.float32)), audio_k, text_k)

    def _sample(self, sp: StepSampling, hidden: torch.Tensor, audio_logits: torch.Tensor | None) -> PendingTokens:
        """Text logits only for rows whose sample is in text mode."""
        seqs, ints, n = sp.seqs, sp.ints, len(sp.seqs)
        if audio_logits is None:
            audio_logits = self.model.audio_logits(hidden[1])  # [R, audio_vocab] float32
        pairs = torch.full((n, 2), -1, dtype=torch.long, device=audio_logits.device)  # [R, (text, audio)]
        sample_audio(audio_logits, self.audio_seen, ints, sp.floats, sp.audio_max_top_k, out=pairs[:, 1])
        text_idx = [i for i, s in enumerate(seqs) if s.sampling_mode() == "text"]
        if not text_idx:
            return PendingTokens(pairs)
        slots, seeds, steps = ints[0], ints[1], ints[2]
        text_t = ChannelTensors.from_columns(sp.floats[3:], ints[6:8], sp.text_max_top_k)
        if len(text_idx) == n:
            sample_rows(self.model.text_logits(hidden[0]), self.text_seen, slots, text_t, seeds, steps, TEXT_CHANNEL,
                        out=pairs[:, 0])
        elif text_idx:
            sel = self._upload(torch.tensor(text_idx, dtype=torch.long))
            text_logits = self.model.text_logits(hidden[0].index_select(0, sel))  # [Rt, vocab] float32
            sub = ChannelTensors(*(x[sel] if isinstance(x, torch.Tensor) else x for x in vars(text_t).values()))
            pairs[sel, 0] = sample_rows(text_logits, self.text_seen, slots[sel], sub, seeds[sel], steps[sel],
                                        TEXT_CHANNEL)
        return PendingTokens(pairs)
