"""The cluster-chain probe's kernel (engines/bench/cluster_chain.py, Hopper: one cluster of 16 blocks, nvcc) against
its torch reference: the estimator call's stages with activations in distributed shared memory and weights fetched
ahead into a second buffer (or not). Tolerance: outputs are rounded to bf16 after sums in another order than
torch's, a last-bit difference that the chain carries on (an input moved by one bf16 step moves a whole call's
output by <= 0.007, mean 0.001, on CPU); a wrong stage moves it by ~0.2 (the output's scale)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a Hopper GPU (thread-block clusters of 16)")


def _check(stages, rows, nb, reps=1, seed=0, mode="full"):
    from engines.bench.cluster_chain import Chain, random_weights, reference_chain

    weights = random_weights(stages, seed=seed)
    x = (torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed)) * 0.5).to(torch.bfloat16)
    chain = Chain.build(stages, weights, rows, torch.device("cuda"))
    got = chain.run(x.cuda(), reps=reps, nb=nb, mode=mode).cpu().float()
    want = reference_chain(stages, weights, x, reps=reps).float()
    err = (got - want).abs()
    assert want.std() > 0.05  # (the chain does not collapse to a constant the kernel could match by accident)
    assert err.max() <= 0.03 and err.mean() <= 0.004, (err.max().item(), err.mean().item())


@pytest.mark.parametrize("rows", [16, 32, 48, 64])
@pytest.mark.parametrize("nb", [1, 2])
def test_one_block_equals_the_reference(rows, nb):
    from engines.bench.cluster_chain import estimator_stages

    _check(estimator_stages(blocks=1, transformers=2), rows, nb)


@pytest.mark.parametrize("rows,nb", [(16, 2), (32, 2), (48, 1)])  # (what fits a block's shared memory)
def test_one_block_gathered_equals_the_reference(rows, nb):  # (inputs copied into each block's memory first)
    from engines.bench.cluster_chain import estimator_stages

    _check(estimator_stages(blocks=1, transformers=2), rows, nb, mode="gather")


@pytest.mark.parametrize("rows,nb", [(16, 2), (32, 2), (32, 1), (48, 1)])  # (what fits a block's shared memory)
def test_one_block_pushed_equals_the_reference(rows, nb):  # (outputs stored into the readers' copies; mma.sync)
    from engines.bench.cluster_chain import estimator_stages

    _check(estimator_stages(blocks=1, transformers=2), rows, nb, mode="push")


def test_the_trace_splits_each_stage_into_its_phases():
    from engines.bench.cluster_chain import Chain, estimator_stages, random_weights

    stages = estimator_stages(blocks=1, transformers=2)
    chain = Chain.build(stages, random_weights(stages), 32, torch.device("cuda"))
    x = (torch.randn(32, 256) * 0.5).to(torch.bfloat16).cuda()
    ns, ghz = chain.trace(x, reps=2, nb=2)
    assert ns.shape == (2 * len(stages), 5) and (ns >= 0).all() and 0.3 < ghz < 3
    per_stage = ns.sum(1)
    assert 100 < per_stage.median() < 1e6  # (nanoseconds: a stage is between 0.1 us and 1 ms)
    assert (ns[:, 2] > 0).all()  # every stage computes something


@pytest.mark.parametrize("nb,mode", [(2, "full"), (1, "gather"), (1, "push")])
def test_a_whole_call_twice_over_equals_the_reference(nb, mode):  # (reps: the stage table wraps, the fetch across it)
    from engines.bench.cluster_chain import estimator_stages

    _check(estimator_stages(), 48, nb, reps=2, mode=mode)
