"""The RNG streams of a checkpoint: the train and validation loaders' own generators, and old states;
how a run seeds its global streams, in one process and per rank."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from nnx_es.rng import LoaderGenerators, capture_rng, generators_mismatch, rank_seed, restore_rng, seed_everything

_DS = TensorDataset(torch.arange(10.0))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_loaders_own_generators_are_its_dataloaders_then_its_samplers_each_once():
    shuffled = DataLoader(_DS, shuffle=True, generator=_gen(1))  # its RandomSampler shares the generator
    assert LoaderGenerators.of(shuffled) == (shuffled.generator, ())
    sampler = RandomSampler(_DS, generator=_gen(2))
    both = DataLoader(_DS, sampler=sampler, generator=_gen(3))
    assert LoaderGenerators.of(both) == (both.generator, (sampler.generator,))
    assert LoaderGenerators.of(DataLoader(_DS, sampler=sampler)).layout == (False, 1)
    assert LoaderGenerators.of(None) == LoaderGenerators.of([1, 2]) == LoaderGenerators()


def test_each_loaders_generator_states_round_trip_through_msgpack():
    train, val = LoaderGenerators(_gen(1), (_gen(2),)), LoaderGenerators(_gen(3), (_gen(4), _gen(5)))
    loaders = {"train": train, "val": val}
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(capture_rng(loaders)))
    expected = [torch.rand(3, generator=g) for g in (train.loader, *train.samplers, val.loader, *val.samplers)]
    restore_rng(state, loaders)
    drawn = [torch.rand(3, generator=g) for g in (train.loader, *train.samplers, val.loader, *val.samplers)]
    assert all(torch.equal(a, b) for a, b in zip(expected, drawn))


def test_a_state_from_before_the_validation_loaders_generators_were_kept_reads_as_none():
    train = LoaderGenerators(_gen(1))
    legacy = capture_rng({"train": train})
    assert "val_loader" not in legacy and "val_samplers" not in legacy
    restore_rng(legacy, {"train": train, "val": LoaderGenerators()})  # no validation generators: resumes
    why = generators_mismatch(legacy, {"train": train, "val": LoaderGenerators(_gen(2))})
    assert why == ("the run's validation loader had no DataLoader generator and 0 sampler generator(s), "
                   "this one has a DataLoader generator and 0 sampler generator(s)")


def test_a_restore_into_other_generators_raises_before_restoring_anything():
    val = LoaderGenerators(None, (_gen(2),))
    state = capture_rng({"train": LoaderGenerators(), "val": val})
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with pytest.raises(ValueError, match="validation loader had no DataLoader generator and 1 sampler"):
        restore_rng(state, {"train": LoaderGenerators(), "val": LoaderGenerators()})
    assert torch.equal(torch.rand(3), expected)  # the global stream untouched


def _draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_one_process_seeds_every_global_stream_with_the_seed_itself():
    assert seed_everything(7) == 7
    seeded = _draws()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    assert seeded == _draws()
    assert seed_everything(7, rank=0, world_size=1) == 7


def test_each_rank_of_a_group_seeds_its_streams_from_its_child_of_the_seeds_seed_sequence():
    child = np.random.SeedSequence(7).spawn(4)[2]  # the documented derivation, for any world size
    assert rank_seed(7, 2) == int(child.generate_state(1, dtype=np.uint64)[0])
    assert seed_everything(7, rank=2, world_size=4) == seed_everything(7, rank=2, world_size=3) == rank_seed(7, 2)
    drawn = _draws()
    seed_everything(rank_seed(7, 2))  # a rank's streams are one process's with its rank seed
    assert drawn == _draws()
    seeds = {rank_seed(s, r) for s in range(64) for r in range(8)}
    assert len(seeds) == 64 * 8  # no two (seed, rank) alike, unlike seed + rank
    assert not seeds & set(range(2**20))  # and none a small seed a user would pick
