"""The cluster-chain probe's host side (engines/bench/cluster_chain.py): the stage list, the weight packing the
kernel reads, its stage records and the torch reference the GPU test checks the kernel against."""

import pytest
import torch
import torch.nn.functional as F

from engines.bench.cluster_chain import (
    CLUSTER,
    SMEM_LIMIT,
    Chain,
    Stage,
    check_stages,
    estimator_stages,
    pack,
    pack_fragments,
    push_regions,
    push_table,
    random_weights,
    reference_chain,
    stage_label,
    table,
    unpack_stage,
    warps_along_n,
)


def test_one_estimator_call_is_308_stages_of_the_served_weight_size():
    stages = estimator_stages()
    assert len(stages) == 14 * (2 + 4 * 5)
    assert sum(st.kind == "attn" for st in stages) == 14 * 4
    params = sum(st.k * st.n for st in stages if st.kind == "gemm")
    assert 128e6 < 2 * params < 130e6  # bytes of bf16: the served estimator reads ~130 MiB a call
    check_stages(stages, 48)


def test_pack_gives_each_block_its_columns_and_unpacks_to_the_weight():
    stages = estimator_stages(blocks=1, transformers=1)
    weights = random_weights(stages, seed=3)
    flat, offsets = pack(stages, weights)
    for st, w, off in zip(stages, weights, offsets, strict=True):
        if w is None:
            continue
        assert torch.equal(unpack_stage(flat, off, st), w.to(torch.bfloat16))
        block = flat[off:off + st.k * st.n].reshape(CLUSTER, st.k, st.n // CLUSTER)[5]  # block 5's slice
        assert torch.equal(block, w.to(torch.bfloat16)[:, 5 * st.n // CLUSTER:6 * st.n // CLUSTER])
    rec = table(stages, offsets)
    assert rec.dtype == torch.int32 and rec.shape == (len(stages), 8)
    assert rec[:, 6].tolist() == offsets and rec[:, 0].tolist() == [int(st.kind == "attn") for st in stages]


def test_table_keeps_offsets_past_two_to_the_31():
    st = Stage("gemm", 256, 256)
    rec = table([st], [2**31 + 48])
    lo, hi = rec[0, 6].item() & 0xFFFFFFFF, rec[0, 7].item()
    assert (hi << 32) | lo == 2**31 + 48


@pytest.mark.parametrize("bad, msg", [
    ([Stage("gemm", 256, 200)], "multiples"),
    ([Stage("gemm", 256, 512, resid=True)], "residual"),
    ([Stage("gemm", 256, 512), Stage("gemm", 512, 256, taps=3)], "conv"),
    ([Stage("gemm", 256, 512)], "end on"),
    ([Stage("gemm", 512, 256)], "reads 512"),
])
def test_shapes_the_kernel_cannot_run_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        check_stages(bad, 48)
    with pytest.raises(ValueError, match="rows"):
        check_stages(estimator_stages(blocks=1, transformers=1), 40)


def test_reference_conv_is_a_causal_conv1d():
    st = [Stage("gemm", 256, 256, taps=3, act=False)]
    w = random_weights(st, seed=1)
    x = torch.randn(48, 256).to(torch.bfloat16)
    got = reference_chain(st, w, x).float()
    weight = w[0].to(torch.bfloat16).float().reshape(3, 256, 256).permute(2, 1, 0)  # [out, in, taps]
    want = F.conv1d(F.pad(x.float().t()[None], (2, 0)), weight)[0].t()
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)


def test_reference_is_causal_over_rows():
    stages = estimator_stages(blocks=1, transformers=2)
    w = random_weights(stages, seed=2)
    x = (torch.randn(48, 256) * 0.5).to(torch.bfloat16)
    y = x.clone()
    y[30:] = (torch.randn(18, 256) * 0.5).to(torch.bfloat16)  # later rows changed
    a, b = reference_chain(stages, w, x), reference_chain(stages, w, y)
    assert torch.equal(a[:30], b[:30]) and not torch.equal(a[30:], b[30:])


@pytest.mark.parametrize("kw, msg", [({"nb": 3}, "1 or 2"), ({"mode": "fast"}, "mode")])
def test_run_refuses_what_the_kernel_does_not_offer(kw, msg):
    stages = estimator_stages(blocks=1, transformers=1)
    chain = Chain.build(stages, random_weights(stages), 32, torch.device("cpu"))
    with pytest.raises(ValueError, match=msg):
        chain.run(torch.zeros(32, 256, dtype=torch.bfloat16), **kw)


def test_plan_fits_the_served_layouts_and_run_refuses_one_that_does_not():
    stages = estimator_stages()
    chain = Chain.build(stages, random_weights(stages), 64, torch.device("cpu"))
    max_slice, max_ld, _, copy, smem = chain.plan(2, "full")
    assert max_slice == 256 * 1536 // CLUSTER  # qkv's slice; attention fetches no weights
    assert max_ld == 1536 // CLUSTER and copy == 0 and smem <= SMEM_LIMIT
    assert chain.plan(2, "gather")[3] == (2 + 64) * 1024  # ff2's whole input, pad rows included
    with pytest.raises(ValueError, match="shared memory"):
        chain.run(torch.zeros(64, 256, dtype=torch.bfloat16), nb=2, mode="gather")


def test_fragments_hold_each_lanes_b_operand_of_mma_m16n8k16():
    stages = estimator_stages(blocks=1, transformers=1)
    weights = random_weights(stages, seed=4)
    flat, offsets = pack(stages, weights)
    frag = pack_fragments(stages, flat, offsets)
    for st, w, off in zip(stages, weights, offsets, strict=True):
        if w is None:  # (attention reads no weights)
            continue
        nc = st.n // CLUSTER
        f = frag[off:off + st.k * st.n].reshape(CLUSTER, st.k // 16, nc // 8, 32, 4)
        wb = w.to(torch.bfloat16)
        for b, ks, t8, lane in [(0, 0, 0, 0), (3, 5, nc // 8 - 1, 31), (15, st.k // 16 - 1, 1, 6)]:
            # PTX: b0 = B[2q, 2q + 1][g], b1 = B[2q + 8, 2q + 9][g], g = lane / 4, q = lane % 4
            g, q = lane // 4, lane % 4
            col = b * nc + t8 * 8 + g
            rows = [ks * 16 + 2 * q, ks * 16 + 2 * q + 1, ks * 16 + 2 * q + 8, ks * 16 + 2 * q + 9]
            assert torch.equal(f[b, ks, t8, lane], wb[rows, col])


@pytest.mark.parametrize("rows", [16, 32, 48, 64])
def test_push_copies_of_neighbouring_stages_never_overlap(rows):
    stages = estimator_stages()
    regions = push_regions(stages, rows)
    sizes = []
    for st, (off, ld) in zip(stages, regions, strict=True):
        width = st.cin if st.kind == "gemm" else 128 + st.n // CLUSTER  # q | k | this block's part of v
        assert ld == width + 8 and off % 16 == 0  # (rows 16 bytes apart in the banks; 32-byte aligned tiles)
        sizes.append((2 + rows) * ld)
    for i in range(len(stages)):  # stage i's copy (read) and stage i + 1's (written by peers), wrapping around
        j = (i + 1) % len(stages)
        (a, _), (b, _) = regions[i], regions[j]
        assert a + sizes[i] <= b or b + sizes[j] <= a, (i, j)


def test_push_refuses_a_chain_that_cannot_wrap():
    with pytest.raises(ValueError, match="wrap"):
        push_regions([Stage("gemm", 256, 256)], 32)  # one stage: its copy is the next call's


def test_push_table_points_each_stage_at_the_next_ones_copy():
    stages = estimator_stages(blocks=2, transformers=2)
    offsets = pack(stages, random_weights(stages))[1]
    rec = push_table(stages, offsets, 32)
    regions = push_regions(stages, 32)
    assert rec.shape == (len(stages), 16) and torch.equal(rec[:, :8], table(stages, offsets))
    for i, st in enumerate(stages):
        nxt = (i + 1) % len(stages)
        assert tuple(rec[i, 8:10].tolist()) == regions[i] and tuple(rec[i, 10:12].tolist()) == regions[nxt]
        assert rec[i, 12].item() == int(stages[nxt].kind == "attn") == int(stage_label(st) == "qkv")
        if stages[nxt].kind == "attn":
            assert rec[i, 13].item() == 512 // CLUSTER


def test_warp_splits_cover_each_gemm_within_the_scratch():
    for st in estimator_stages(blocks=1, transformers=1):
        if st.kind != "gemm":
            continue
        wn, nt8 = warps_along_n(st, 48), st.n // CLUSTER // 8
        assert 8 % wn == 0 and nt8 % wn == 0 and nt8 // wn <= 4 and (8 // wn) * st.n // CLUSTER <= 192
    with pytest.raises(ValueError, match="warp split"):
        warps_along_n(Stage("gemm", 256, 16 * 8 * 5), 32)  # 5 n8 tiles a block


def test_push_plan_fits_32_rows_with_two_buffers_48_with_one():
    stages = estimator_stages()
    w = random_weights(stages)
    assert Chain.build(stages, w, 32, torch.device("cpu")).push_plan(2)[-1] <= SMEM_LIMIT
    chain = Chain.build(stages, w, 48, torch.device("cpu"))
    assert chain.push_plan(1)[-1] <= SMEM_LIMIT < chain.push_plan(2)[-1]
    with pytest.raises(ValueError, match="shared memory"):
        chain.run(torch.zeros(48, 256, dtype=torch.bfloat16), nb=2, mode="push")
