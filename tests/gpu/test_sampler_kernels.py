"""The sampler's kernels (race noise, staged top-k, the fused top-k sampler) against the torch sampler.
Run: python3 -m pytest tests/gpu (needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from engines.api import ChannelSampling

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")


@pytest.mark.parametrize("channel", [0, 1])
def test_race_noise_kernel_is_bit_identical_to_torch(channel):
    from engines.kernels.lm.sampling import race_noise
    from engines.lm.sampler import exponential_noise, row_keys

    g = torch.Generator(device="cuda").manual_seed(5)
    for b, k in [(1, 50), (7, 16512), (3, 1)]:
        seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda", generator=g)
        steps = torch.randint(0, 10_000, (b,), device="cuda", generator=g)
        ids = torch.randint(0, 151680, (b, k), device="cuda", generator=g)
        ref = exponential_noise(row_keys(seeds, steps, channel), ids)
        got = race_noise(seeds, steps, channel, ids)
        assert torch.isfinite(got).all()
        assert torch.equal(got, ref)
        # and against the CPU path, which the CPU tests pin
        assert torch.allclose(got.cpu(), exponential_noise(row_keys(seeds.cpu(), steps.cpu(), channel), ids.cpu()),
                              rtol=1e-6, atol=0)


@pytest.mark.parametrize("width", [16512, 151680, 5000])
def test_two_stage_top_k_equals_torch_topk(width):
    """The sampler's staged top-k (slices of 128, then the candidates) == torch.topk: same sorted values, and
    indices that hold those values; with masked (-inf) tails as the audio channel has, and a width that needs
    padding (5000)."""
    from engines.lm.sampler import top_k

    g = torch.Generator(device="cuda").manual_seed(9)
    for rows, k in [(1, 20), (5, 1), (3, 64)]:
        x = torch.randn(rows, width, device="cuda", generator=g) * 3
        x[:, width - width // 100:] = float("-inf")
        vals, idx = top_k(x, k)
        ref_vals, ref_idx = torch.topk(x, k, dim=-1)
        assert torch.equal(vals, ref_vals)
        assert torch.equal(torch.gather(x, 1, idx), vals)
        assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)  # no ties among random floats
    few = torch.full((2, width), float("-inf"), device="cuda")
    few[:, 7] = 1.0  # fewer finite entries than k: the rest are -inf at real (in-range) indices
    vals, idx = top_k(few, 20)
    assert vals[:, 0].eq(1.0).all() and idx[:, 0].eq(7).all() and torch.isinf(vals[:, 1:]).all()
    assert int(idx.max()) < width


@pytest.mark.parametrize("vocab,audio", [(16512, True), (151680, False), (3000, False)])
def test_fused_top_k_sampler_draws_the_torch_paths_tokens(vocab, audio):
    """engines/kernels/lm/topk_sample.py against the torch sampler (mask, penalty over a slot's history, temperature,
    top-k, top-p, noise race, greedy) on random rows with per-row parameters: the same token in every row. Both
    paths draw with the same counter-based noise, so only last-bit differences of softmax/cumsum could make them
    differ, and these rows have none. The logits are left intact."""
    from engines.kernels.lm import topk_sample
    from engines.lm.sampler import (
        AUDIO_CHANNEL,
        TEXT_CHANNEL,
        ChannelTensors,
        mask_audio_logits,
        sample_channel,
        sample_rows,
    )

    g = torch.Generator(device="cuda").manual_seed(11)
    channel = AUDIO_CHANNEL if audio else TEXT_CHANNEL
    for b, max_k in [(1, 20), (9, 64), (33, 1), (64, 32)]:
        logits = torch.randn(b, vocab, device="cuda", generator=g) * 4
        seen = torch.rand(80, vocab, device="cuda", generator=g) < 0.05
        slots = torch.randperm(80, device="cuda", generator=g)[:b]
        ks = torch.randint(1, max_k + 1, (b,), device="cuda", generator=g)
        ks[0] = max_k
        t = ChannelTensors(
            temperature=torch.rand(b, device="cuda", generator=g) * 1.5 + 0.1,
            top_p=torch.where(torch.rand(b, device="cuda", generator=g) < 0.3, 1.0,
                              torch.rand(b, device="cuda", generator=g) * 0.9 + 0.05),
            top_k=ks, penalty=torch.rand(b, device="cuda", generator=g) + 0.8,
            greedy=torch.rand(b, device="cuda", generator=g) < 0.25, max_top_k=max_k)
        seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda", generator=g)
        steps = torch.randint(0, 50, (b,), device="cuda", generator=g)
        min_new = torch.randint(0, 50, (b,), device="cuda", generator=g) if audio else None
        if audio:  # end of speech is the best logit in every row: gated where steps < min_new
            logits[:, 16384] = 60.0
            logits[:, 16385:] = 90.0  # never drawn
        before = logits.clone()
        assert topk_sample.supported(logits, max_k)
        got = sample_rows(logits, seen, slots, t, seeds, steps, channel, min_new)
        assert torch.equal(logits, before)
        masked = mask_audio_logits(logits.clone(), steps, min_new) if audio else logits
        ref = sample_channel(masked, seen[slots], t, seeds, steps, channel)  # sample_rows' torch path
        assert torch.equal(got, ref), (b, max_k, (got != ref).nonzero().flatten().tolist())
        if audio:
            assert int(got.max()) <= 16384
            gated = steps < min_new
            assert not got[gated].eq(16384).any() and got[~gated & t.greedy].eq(16384).all()


def test_fused_top_k_sampler_compiles_once_for_every_batch_and_column_offset():
    """The per-row columns are views into the step's staged upload at offsets that move with the batch size: after
    the first call, no batch size or offset compiles another kernel (a compile while serving stalls every session;
    a 12-session load test once waited 2.1 s for one)."""
    from engines.kernels.lm import topk_sample

    def compiled() -> int:
        return sum(len(c[0]) for k in (topk_sample._candidates_kernel, topk_sample._pick_kernel)
                   for c in k.device_caches.values())

    g = torch.Generator(device="cuda").manual_seed(12)
    vocab = 16512
    seen = torch.zeros(80, vocab, dtype=torch.bool, device="cuda")
    words = torch.zeros(4096, dtype=torch.long, device="cuda")  # int columns, packed as the staged upload packs them
    floats = torch.ones(4096, dtype=torch.float32, device="cuda")
    counts = []
    for b in (1, 2, 3, 5, 8, 12, 13):
        for shift in (0, 1, 3):  # every column starts at another word offset
            cols = [words[shift + i * b: shift + (i + 1) * b] for i in range(5)]  # slots, top_k, greedy, seeds, steps
            slots, top_k, greedy, seeds, steps = cols
            slots.copy_(torch.arange(b))
            top_k.fill_(20)
            temp, top_p, penalty = (floats[shift + i * b: shift + (i + 1) * b] for i in range(3))
            pairs = torch.zeros(b, 2, dtype=torch.long, device="cuda")
            logits = torch.randn(b, vocab, device="cuda", generator=g)
            topk_sample.topk_sample(logits, seen, slots, temp, top_p, top_k, penalty, greedy, seeds, steps, 1, 20,
                                    out=pairs[:, 1])
            assert pairs[:, 1].lt(vocab).all()
            counts.append(compiled())
    assert counts[0] >= 2 and len(set(counts)) == 1, counts


def test_fused_top_k_sampler_greedy_ties_pick_the_lowest_id():
    """Equal best logits: greedy takes the lowest id (torch.argmax's rule), also across the kernel's slices."""
    from engines.lm.sampler import ChannelTensors, sample_rows

    logits = torch.full((2, 16512), -5.0, device="cuda")
    logits[0, [9000, 70, 4000]] = 3.0
    logits[1, [16000, 1100]] = 3.0
    t = ChannelTensors.build([ChannelSampling(top_k=20)] * 2, [True, True], torch.device("cuda"))
    seen = torch.zeros(2, 16512, dtype=torch.bool, device="cuda")
    got = sample_rows(logits, seen, torch.arange(2, device="cuda"), t, torch.zeros(2, dtype=torch.long, device="cuda"),
                      torch.zeros(2, dtype=torch.long, device="cuda"), 0)
    assert got.tolist() == [70, 1100]
