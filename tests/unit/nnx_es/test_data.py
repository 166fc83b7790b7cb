"""Gathered batches equal the DataLoader's own: values, types, order and RNG draws."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from nnx_es import Trainer
from nnx_es.data import gatherable, iterate_batches
from trainkit import loaders, params_of, read_events, small_net


def _dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 5, (n,), generator=g),
                         torch.rand(n, generator=g, dtype=torch.float64))


def _loader(ds: TensorDataset, kind: str, batch_size: int, drop_last: bool, seed: int) -> DataLoader:
    if kind == "shuffle":
        return DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=drop_last,
                          generator=torch.Generator().manual_seed(seed))
    if kind == "weighted":
        gen = torch.Generator().manual_seed(seed)
        sampler = WeightedRandomSampler(torch.rand(len(ds), generator=torch.Generator().manual_seed(1)) + 0.1,
                                        num_samples=len(ds), generator=gen)
        return DataLoader(ds, batch_size=batch_size, sampler=sampler, drop_last=drop_last, generator=gen)
    return DataLoader(ds, batch_size=batch_size, shuffle=False, drop_last=drop_last)  # global RNG, sequential


def _epochs(loader: DataLoader, epochs: int, gather: bool, global_seed: int) -> tuple[list, list]:
    torch.manual_seed(global_seed)
    seen, states = [], []
    for _ in range(epochs):
        seen.append(list(iterate_batches(loader, gather=gather) if gather else loader))
        gen = loader.generator
        states.append((gen.get_state() if gen is not None else None, torch.get_rng_state()))
    return seen, states


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), batch_size=st.integers(1, 12), drop_last=st.booleans(),
       kind=st.sampled_from(["shuffle", "weighted", "sequential"]), seed=st.integers(0, 2**16))
def test_gathered_batches_equal_the_dataloaders_and_leave_the_rng_where_it_does(n, batch_size, drop_last, kind, seed):
    ds = _dataset(n, seed)
    loader = _loader(ds, kind, batch_size, drop_last, seed)
    assert gatherable(loader)
    expected, expected_states = _epochs(loader, 3, gather=False, global_seed=seed)
    loader = _loader(ds, kind, batch_size, drop_last, seed)  # same seeds again
    got, got_states = _epochs(loader, 3, gather=True, global_seed=seed)
    assert len(got) == len(expected)
    for epoch_got, epoch_expected in zip(got, expected):
        assert len(epoch_got) == len(epoch_expected)
        for b_got, b_exp in zip(epoch_got, epoch_expected):
            assert type(b_got) is type(b_exp) is list
            assert all(torch.equal(g, e) and g.dtype == e.dtype and g.shape == e.shape for g, e in zip(b_got, b_exp))
    for (g_gen, g_glob), (e_gen, e_glob) in zip(got_states, expected_states):
        assert (g_gen is None and e_gen is None) or torch.equal(g_gen, e_gen)
        assert torch.equal(g_glob, e_glob)


class _Augmented(TensorDataset):
    def __getitem__(self, i):
        x, *rest = super().__getitem__(i)
        return (x + 1, *rest)


@pytest.mark.parametrize("make", [
    lambda ds: DataLoader(_Augmented(*ds.tensors), batch_size=4),
    lambda ds: DataLoader(ds, batch_size=4, collate_fn=lambda rows: rows),
    lambda ds: DataLoader(ds, batch_size=4, num_workers=1),
    lambda ds: DataLoader(ds, batch_size=None),
    lambda ds: type("MyLoader", (DataLoader,), {})(ds, batch_size=4),
    lambda ds: [[t[:4] for t in ds.tensors]],
], ids=["dataset-subclass", "custom-collate", "workers", "no-batching", "loader-subclass", "a-list"])
def test_anything_else_is_iterated_as_given(make):
    loader = make(_dataset(8, 0))
    assert not gatherable(loader)
    if not (isinstance(loader, DataLoader) and loader.num_workers):
        got = list(iterate_batches(loader))
        expected = list(loader)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert type(g) is type(e)
            if isinstance(e, (list, tuple)) and isinstance(e[0], torch.Tensor):
                assert all(torch.equal(a, b) for a, b in zip(g, e))  # e.g. the subclass's +1 kept


def _untimed_events(run_dir) -> list:
    out = []
    for seq, e in read_events(run_dir):
        d = msgspec.to_builtins(e)
        for key in ("wall_time_s", "duration_s", "library_versions", "run_id", "started_at", "manifest", "blobs"):
            d.pop(key, None)
        if "record" in d:
            d["record"].pop("wall_time_s", None)
        out.append((seq, d))
    return out


def test_a_run_trains_the_same_with_and_without_gathering(tmp_path):
    runs = {}
    for gather in (True, False):
        net = small_net(3)
        trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=0.05), nn.CrossEntropyLoss(),
                          monitor="val_loss", runs_root=tmp_path, run_id=f"g{gather}", progress=False,
                          batch_gather=gather)
        train, val = loaders(batch_size=5, n_train=33, n_val=14, seed=4)
        run = trainer.fit(train, val, epochs=3)
        runs[gather] = (params_of(net), _untimed_events(run.run_dir), run.history)
    (p1, e1, h1), (p0, e0, h0) = runs[True], runs[False]
    assert all(torch.equal(p1[k], p0[k]) for k in p0)
    assert e1 == e0
    assert [r.val for r in h1] == [r.val for r in h0] and [r.train for r in h1] == [r.train for r in h0]


def test_batch_gather_must_be_a_bool(tmp_path):
    from nnx_es.errors import ConfigError

    net = small_net(0)
    with pytest.raises(ConfigError, match="batch_gather must be True or False, got 'no'"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), batch_gather="no")


class _EagerBatches:
    """A batch sampler that shuffles as soon as it is iterated (not a generator function)."""

    def __init__(self, n: int, size: int, gen: torch.Generator) -> None:
        self.n, self.size, self.gen = n, size, gen

    def __iter__(self):
        perm = torch.randperm(self.n, generator=self.gen).tolist()
        return iter([perm[i:i + self.size] for i in range(0, self.n, self.size)])

    def __len__(self) -> int:
        return -(-self.n // self.size)


def test_an_eager_batch_sampler_is_iterated_once_per_epoch_as_the_dataloader_does():
    ds = _dataset(20, 1)
    runs = []
    for gather in (True, False):
        gen = torch.Generator().manual_seed(5)
        loader = DataLoader(ds, batch_sampler=_EagerBatches(20, 6, gen), generator=gen)
        assert gatherable(loader)
        runs.append(_epochs(loader, 3, gather=gather, global_seed=0))
    (got, got_states), (expected, expected_states) = runs
    for eg, ee in zip(got, expected):
        assert all(torch.equal(a, b) for bg, be in zip(eg, ee) for a, b in zip(bg, be))
    assert all(torch.equal(g[0], e[0]) for g, e in zip(got_states, expected_states))


def test_gathered_batches_are_contiguous_like_the_stacked_ones():
    images = torch.randn(10, 3, 5, 5).to(memory_format=torch.channels_last)
    ds = TensorDataset(images, torch.arange(10))
    (got,) = list(iterate_batches(DataLoader(ds, batch_size=10)))
    (expected,) = list(DataLoader(ds, batch_size=10))
    assert got[0].stride() == expected[0].stride() and torch.equal(got[0], expected[0])


@pytest.mark.parametrize("indices", [[0.0, 1.0], [True, False, True], [], [[0, 1]]], ids=["floats", "bools", "empty", "nested"])
def test_odd_indices_take_the_dataloaders_own_path(indices):
    ds = _dataset(6, 2)
    loader = DataLoader(ds, batch_sampler=[indices])
    try:
        expected = list(loader)
    except Exception as exc:  # the DataLoader refuses: so must the gathered path, the same way
        with pytest.raises(type(exc)):
            list(iterate_batches(loader))
        return
    got = list(iterate_batches(loader))
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for g, e in zip(got, expected) for a, b in zip(g, e))


def test_without_the_iterators_sampler_iterator_the_epoch_is_the_dataloaders_own(monkeypatch):
    import nnx_es.data

    ds = _dataset(12, 3)
    expected, expected_states = _epochs(_loader(ds, "shuffle", 5, False, 3), 2, gather=False, global_seed=0)
    monkeypatch.setattr(nnx_es.data, "_SAMPLER_ITER", "_kept_elsewhere")  # a torch that keeps it elsewhere
    got, got_states = _epochs(_loader(ds, "shuffle", 5, False, 3), 2, gather=True, global_seed=0)
    assert all(torch.equal(a, b) for eg, ee in zip(got, expected) for bg, be in zip(eg, ee) for a, b in zip(bg, be))
    assert all(torch.equal(g[0], e[0]) and torch.equal(g[1], e[1]) for g, e in zip(got_states, expected_states))
