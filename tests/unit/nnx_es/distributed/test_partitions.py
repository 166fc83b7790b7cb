"""Partitions of nnx_es.distributed with explicit rank and world arguments (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from nnx_es.distributed import partition_indices, shard_indices, train_loader, validation_loader
from nnx_es.errors import ConfigError


@pytest.mark.parametrize("n,world", [(10, 2), (11, 2), (7, 3), (2, 3), (64, 4)])
def test_pad_gives_every_rank_the_same_count_and_covers_every_row(n: int, world: int) -> None:
    parts = [partition_indices(n, rank=r, world_size=world, epoch=2, seed=5) for r in range(world)]
    assert {len(p) for p in parts} == {-(-n // world)}
    assert set().union(*parts) == set(range(n))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    dealt = [i for pos in range(len(parts[0])) for p in parts for i in [p[pos]]]
    # the permutation, padded with its leading rows, dealt round-robin
    assert dealt[:n] == order
    assert dealt[n:] == (order * world)[:len(dealt) - n]


@pytest.mark.parametrize("n,world", [(10, 2), (11, 2), (7, 3)])
def test_drop_leaves_out_the_tail_and_no_row_twice(n: int, world: int) -> None:
    parts = [partition_indices(n, rank=r, world_size=world, epoch=0, seed=1, policy="drop") for r in range(world)]
    assert {len(p) for p in parts} == {n // world}
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == n // world * world


def test_each_epoch_is_seeded_by_seed_plus_epoch() -> None:
    a = partition_indices(20, rank=0, world_size=2, epoch=3, seed=4)
    assert a == partition_indices(20, rank=0, world_size=2, epoch=2, seed=5)
    assert a != partition_indices(20, rank=0, world_size=2, epoch=4, seed=4)


def test_validation_shards_unpadded_and_a_rank_may_have_none() -> None:
    assert [shard_indices(5, rank=r, world_size=3) for r in range(3)] == [[0, 3], [1, 4], [2]]
    assert shard_indices(1, rank=1, world_size=2) == []
    loader = validation_loader(TensorDataset(torch.arange(1.0)), 4, rank=1, world_size=2)
    assert len(loader) == 0 and list(loader) == []


def test_train_loader_follows_set_epoch() -> None:
    data = TensorDataset(torch.arange(9.0))
    loader = train_loader(data, 2, seed=0, rank=1, world_size=2)
    assert len(loader) == 3
    loader.sampler.set_epoch(1)
    got = [int(x) for (b,) in loader for x in b]
    assert got == partition_indices(9, rank=1, world_size=2, epoch=1, seed=0)


@pytest.mark.parametrize("kwargs,word", [
    (dict(policy="wrap"), "policy"), (dict(rank=2, world_size=2), "rank=2"), (dict(batch_size=0), "batch_size"),
    (dict(sampler=[0]), "sampler"),
])
def test_bad_arguments_are_refused_by_name(kwargs: dict, word: str) -> None:
    args = dict(batch_size=2, rank=0, world_size=2) | kwargs
    with pytest.raises(ConfigError, match=word):
        train_loader(TensorDataset(torch.arange(4.0)), **args)


def test_drop_with_fewer_rows_than_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match="drop"):
        partition_indices(1, rank=0, world_size=2, epoch=0, seed=0, policy="drop")
