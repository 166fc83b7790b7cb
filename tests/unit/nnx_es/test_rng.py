"""The RNG streams of a checkpoint: the train and validation loaders' own generators, and old states."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from nnx_es.rng import LoaderGenerators, capture_rng, generators_mismatch, restore_rng

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
