"""Elastic mode's deal (nnx_es.distributed.global_batch) and the RNG rule of a world change
(nnx_es.distributed.resize.successor_streams), without a process group."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from nnx_es.distributed import elastic_loader, partition_indices
from nnx_es.distributed.global_batch import GlobalBatchSampler, global_batches, plan_global_batch, working_sizes
from nnx_es.distributed.resize import successor_streams
from nnx_es.errors import ConfigError
from nnx_es.rng import capture_rng


@pytest.mark.parametrize("world, cap, rows, micro, k", [
    (1, None, 12, 12, 1), (2, None, 6, 6, 1), (1, 4, 12, 4, 3), (2, 4, 6, 3, 2), (3, 4, 4, 4, 1),
    (1, 5, 12, 4, 3),  # no split of 12 into microbatches of 5: the smallest window whose microbatch fits
    (12, 4, 1, 1, 1), (4, 1, 3, 1, 3)])
def test_a_plan_splits_the_global_batch_over_the_ranks_and_their_microbatches(world, cap, rows, micro, k):
    plan = plan_global_batch(12, world, cap)
    assert (plan.rows_per_rank, plan.microbatch_rows, plan.accumulation) == (rows, micro, k)
    assert plan.world_size * plan.accumulation * plan.microbatch_rows == 12


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_naming_those_that_do():
    with pytest.raises(ConfigError) as err:
        plan_global_batch(12, 5)
    assert "global_batch=12" in str(err.value) and "5 ranks" in str(err.value)
    assert "sizes that work: 1, 2, 3, 4, 6, 12" in str(err.value)
    assert working_sizes(8) == [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="microbatch must be an int >= 1"):
        plan_global_batch(12, 2, 0)


@pytest.mark.parametrize("world, cap", [(1, None), (2, 3), (4, 1), (6, None)])
def test_every_world_size_deals_the_same_global_batches_row_by_row(world, cap):
    n, g, seed = 40, 12, 9  # 3 global batches an epoch, 4 rows left out
    for epoch in (0, 3):
        want = global_batches(n, global_batch=g, epoch=epoch, seed=seed)
        # the permutation train_loader draws for the epoch, cut in global batches; its tail left out
        order = partition_indices(n, rank=0, world_size=1, epoch=epoch, seed=seed)
        assert want == [order[0:12], order[12:24], order[24:36]]
        samplers = [GlobalBatchSampler(n, global_batch=g, rank=r, world_size=world, microbatch=cap, seed=seed)
                    for r in range(world)]
        for s in samplers:
            s.set_epoch(epoch)
        dealt = [list(s) for s in samplers]
        per = g // world
        got = [[i for rows in dealt for i in rows[u * per:(u + 1) * per]] for u in range(3)]
        assert got == want
        assert all(len(s) == 3 * per for s in samplers)


def test_the_loader_batches_a_whole_number_of_microbatches_per_update():
    data = TensorDataset(torch.arange(30.0).unsqueeze(1), torch.zeros(30, dtype=torch.long))
    loader = elastic_loader(data, 8, microbatch=3, seed=1, rank=1, world_size=2)  # 4 rows a rank: 2 x 2
    assert (loader.batch_size, loader.sampler.plan.accumulation, len(loader)) == (2, 2, 6)  # 3 updates an epoch
    rows = [int(v) for x, _ in loader for v in x.flatten()]
    want = [i for b in global_batches(30, global_batch=8, epoch=0, seed=1) for i in b[4:8]]
    assert rows == want
    desc = loader.sampler.describe()
    assert {k: desc[k] for k in ("kind", "rows", "global_batch", "world_size", "accumulation", "seed")} == {
        "kind": "global_batch", "rows": 30, "global_batch": 8, "world_size": 2, "accumulation": 2, "seed": 1}
    with pytest.raises(ConfigError, match="drop batch_size="):
        elastic_loader(data, 8, batch_size=4, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        elastic_loader(data, 32, rank=0, world_size=1)


def _streams(n: int) -> list[dict]:
    out = []
    for r in range(n):
        torch.manual_seed(100 + r)
        np.random.seed(100 + r)
        random.seed(100 + r)
        out.append(capture_rng({}))
    return out


def test_a_rank_the_checkpoint_had_keeps_its_streams_and_a_new_rank_starts_its_own():
    old = _streams(2)
    before = capture_rng({})
    assert successor_streams(old, 0) == old[0] and successor_streams(old, 1) == old[1]
    grown = [successor_streams(old, r) for r in range(4)]
    assert capture_rng({}) == before  # deriving them leaves this process's streams alone
    torch_streams = [s["torch"] for s in grown]
    assert len(set(torch_streams)) == 4  # every rank its own stream ...
    assert len({bytes(s["numpy"]["keys"]) for s in grown}) == 4 and len({tuple(s["python"]["internal"])
                                                                      for s in grown}) == 4
    assert [successor_streams(old, r) for r in range(4)] == grown  # ... a function of the checkpoint alone
    # the draws a new rank makes differ from its donor's (rank 2's donor is rank 0)
    gen = [torch.Generator() for _ in range(2)]
    for g, s in zip(gen, (grown[0], grown[2])):
        g.set_state(torch.frombuffer(bytearray(s["torch"]), dtype=torch.uint8).clone())
    assert not torch.equal(torch.rand(8, generator=gen[0]), torch.rand(8, generator=gen[1]))
