"""Serving model over the paged KV cache vs the dense reference, on a tiny real-layout checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from engines.lm.loader.checkpoint import load_model
from engines.lm.model.batch import ForwardBatch
from engines.tokens import AUDIO_PAD, EOSP, IM_END, IM_START, MODALITY_PAD, SOSP, audio_span_rows, text_rows
from tests.reference.dense_model import dense_from_checkpoint

ATOL = RTOL = 1e-4  # float32 end to end; paged and dense differ only in summation order
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, "cpu", torch.float32)


@pytest.fixture(scope="module")
def dense(tiny_checkpoint):
    return dense_from_checkpoint(tiny_checkpoint)


def make_rows(seed: int, n_text_before: int, n_codes: int, n_text_after: int) -> torch.Tensor:
    rng = random.Random(seed)
    rows = text_rows([IM_START] + [rng.randrange(0, 151000) for _ in range(n_text_before)])
    rows += audio_span_rows([rng.randrange(0, 16384) for _ in range(n_codes)])
    rows += text_rows([rng.randrange(0, 151000) for _ in range(n_text_after)] + [IM_END])
    return torch.tensor(rows, dtype=torch.long)  # [L, 2]


class PagedSeq:
    """Test-side stand-in for the KV pool: a sequence's rows, cached length and (scattered) blocks."""

    def __init__(self, rows: torch.Tensor, free: list[int]):
        self.rows, self.free, self.cached, self.blocks = rows, free, 0, []


def make_batch(steps: list[tuple[PagedSeq, int]], block_size: int, all_logits: bool = False) -> ForwardBatch:
    """Schedule `n` new rows for each (seq, n); logits at each sequence's last new row (or every row)."""
    rows, positions, slots, starts, ctx, tables, logits_rows = [], [], [], [0], [], [], []
    for seq, n in steps:
        end = seq.cached + n
        while len(seq.blocks) * block_size < end:
            seq.blocks.append(seq.free.pop())
        for p in range(seq.cached, end):
            rows.append(seq.rows[p])
            positions.append(p)
            slots.append(seq.blocks[p // block_size] * block_size + p % block_size)
        first = starts[-1]
        starts.append(first + n)
        logits_rows += list(range(first, first + n)) if all_logits else [first + n - 1]
        ctx.append(end)
        tables.append(list(seq.blocks))
        seq.cached = end
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    lt = lambda x: torch.tensor(x, dtype=torch.long)
    return ForwardBatch(
        rows=torch.stack(rows), positions=lt(positions), slot_mapping=lt(slots), query_start=lt(starts),
        context_lens=lt(ctx), block_tables=lt(tables), logits_rows=lt(logits_rows),
        max_query_len=max(n for _, n in steps), max_context_len=max(ctx),
        is_decode=all(n == 1 for _, n in steps))


def new_cache(model, block_size: int) -> tuple[torch.Tensor, list[int]]:
    c = model.config
    cache = torch.zeros(c.num_attention_layers, 2, NUM_BLOCKS, block_size, c.num_key_value_heads, c.head_dim)
    free = list(range(NUM_BLOCKS))
    random.Random(block_size).shuffle(free)  # block tables are not contiguous in a real pool
    return cache, free


def run(model, batch: ForwardBatch, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        h = model(batch, cache)  # [2, R, hidden]
        return model.text_logits(h[0]), model.audio_logits(h[1])


def assert_close(got: tuple[torch.Tensor, torch.Tensor], want_text: torch.Tensor, want_audio: torch.Tensor):
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], want_text, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[1], want_audio, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [1, 16])
def test_single_prefill_matches_dense(model, dense, block_size):
    rows = make_rows(1, 12, 20, 6)  # 42 rows with an audio span in the middle
    want_text, want_audio = dense(rows)
    cache, free = new_cache(model, block_size)
    seq = PagedSeq(rows, free)
    got = run(model, make_batch([(seq, len(rows))], block_size, all_logits=True), cache)
    assert got[0].shape == (len(rows), model.config.vocab_size)
    assert got[1].shape == (len(rows), model.config.audio_vocab_size)
    assert_close(got, want_text, want_audio)


@pytest.mark.parametrize("block_size", [1, 16])
def test_chunked_prefill_then_decode_matches_dense(model, dense, block_size):
    rows = make_rows(2, 8, 24, 10)  # 45 rows
    want_text, want_audio = dense(rows)
    cache, free = new_cache(model, block_size)
    seq = PagedSeq(rows, free)
    prefill = 30
    while seq.cached < prefill:
        n = min(7, prefill - seq.cached)
        got = run(model, make_batch([(seq, n)], block_size), cache)
        last = seq.cached - 1
        assert_close(got, want_text[last:last + 1], want_audio[last:last + 1])
    while seq.cached < len(rows):
        got = run(model, make_batch([(seq, 1)], block_size), cache)
        last = seq.cached - 1
        assert_close(got, want_text[last:last + 1], want_audio[last:last + 1])


@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_batch_matches_dense(model, dense, block_size):
    cache, free = new_cache(model, block_size)
    a = PagedSeq(make_rows(3, 10, 8, 4), free)  # 26 rows: 24 cached, then one decode row
    b = PagedSeq(make_rows(4, 5, 0, 5), free)  # 14 rows: whole prompt in this pass
    c = PagedSeq(make_rows(5, 3, 12, 2), free)  # 21 rows: 9 cached, then a 12-row chunk
    run(model, make_batch([(a, 24), (c, 9)], block_size), cache)
    step = [(a, 1), (b, len(b.rows)), (c, 12)]
    got = run(model, make_batch(step, block_size, all_logits=True), cache)
    want_text, want_audio = [], []
    for seq, n in step:
        t, au = dense(seq.rows)
        want_text.append(t[seq.cached - n:seq.cached])
        want_audio.append(au[seq.cached - n:seq.cached])
    assert_close(got, torch.cat(want_text), torch.cat(want_audio))


def test_logits_rows_subset_and_empty(model, dense):
    """Only the requested rows come back, in the requested order; a chunk may request none."""
    rows = make_rows(6, 6, 6, 3)
    want_text, want_audio = dense(rows)
    cache, free = new_cache(model, 16)
    batch = make_batch([(PagedSeq(rows, free), len(rows))], 16)
    batch.logits_rows = torch.tensor([9, 2, 15])
    assert_close(run(model, batch, cache), want_text[[9, 2, 15]], want_audio[[9, 2, 15]])
    batch.logits_rows = torch.tensor([], dtype=torch.long)
    with torch.no_grad():
        assert model(batch, torch.zeros_like(cache)).shape == (2, 0, model.config.hidden_size)


def test_embedding_row_rule(model):
    rows = torch.tensor([(IM_START, AUDIO_PAD), (SOSP, AUDIO_PAD), (MODALITY_PAD, 7), (MODALITY_PAD, EOSP),
                         (1234, 16000)])
    emb = model.embed(rows)
    text_w, audio_w = model.embed_tokens.weight, model.audio_embed.weight
    torch.testing.assert_close(emb[0], text_w[IM_START], rtol=0, atol=0)
    torch.testing.assert_close(emb[1], text_w[SOSP], rtol=0, atol=0)
    torch.testing.assert_close(emb[2], audio_w[7], rtol=0, atol=0)
    torch.testing.assert_close(emb[3], audio_w[EOSP], rtol=0, atol=0)
    torch.testing.assert_close(emb[4], text_w[1234], rtol=0, atol=0)  # a text row's audio token is ignored


def test_both_tails_write_kv_in_their_own_layers(model):
    block_size = 4
    cache, free = new_cache(model, block_size)
    seq = PagedSeq(make_rows(7, 3, 2, 1), free)
    batch = make_batch([(seq, len(seq.rows))], block_size)
    with torch.no_grad():
        model(batch, cache)
    flat = cache.view(cache.shape[0], 2, -1, *cache.shape[-2:])  # [layers, 2, slots, kv_heads, d]
    written = torch.zeros(flat.shape[2], dtype=torch.bool)
    written[batch.slot_mapping] = True
    for layer in range(model.config.num_attention_layers):
        for kv in range(2):
            assert (flat[layer, kv, written].abs().sum(-1) > 0).all(), f"layer {layer} kv {kv} not written"
            assert (flat[layer, kv, ~written] == 0).all(), f"layer {layer} kv {kv} wrote outside its slots"
    shared, text_tail, audio_tail = model.tail_layer_ranges()
    assert list(shared) + list(text_tail) + list(audio_tail) == list(range(model.config.num_attention_layers))
    # Same input hidden states, different weights: the two tails' caches must differ.
    assert not torch.allclose(flat[text_tail[0], :, written], flat[audio_tail[0], :, written])
