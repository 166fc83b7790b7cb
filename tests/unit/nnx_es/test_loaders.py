"""Loader geometry (recorded in run_started, compared on a stateful resume) and per-epoch worker seeding."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from events.schema import LoaderGeometry
from nnx_es.data import iterate_batches
from nnx_es.loaders import geometry_mismatch, loader_geometries, loader_geometry

torch.set_num_threads(1)


def test_loader_geometry_says_what_a_loader_says_and_none_elsewhere():
    ds = TensorDataset(torch.zeros(10, 2))
    assert loader_geometry(DataLoader(ds, batch_size=4, drop_last=True)) == LoaderGeometry(
        batch_size=4, batches_per_epoch=2, drop_last=True, dataset_length=10)
    assert loader_geometry([1, 2, 3]) == LoaderGeometry(batches_per_epoch=3)
    assert loader_geometry(iter([1])) == LoaderGeometry()
    assert loader_geometries({"train": [1], "val": None}) == {"train": LoaderGeometry(batches_per_epoch=1)}


def test_geometry_mismatch_names_each_changed_field_old_and_new():
    old = {"train": LoaderGeometry(batch_size=20, batches_per_epoch=5, drop_last=False, dataset_length=100)}
    new = {"train": LoaderGeometry(batch_size=50, batches_per_epoch=2, drop_last=False, dataset_length=100),
           "val": LoaderGeometry(batch_size=8)}
    assert geometry_mismatch(old, new) == (
        "the train loader's geometry differs from the run's: batch_size 20 -> 50, batches_per_epoch 5 -> 2")
    assert geometry_mismatch(old, {"train": old["train"]}) is None
    assert geometry_mismatch(old, {}) is None  # a role only one side holds is not compared


class Noisy(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        time.sleep(0.01)  # slow enough that a left epoch's prefetched batches are still being fetched
        return torch.rand(2)


@pytest.mark.parametrize("abandon", [False, True], ids=["whole_epochs", "an_epoch_left_unfinished"])
def test_persistent_workers_draw_each_epoch_as_fresh_workers_would(abandon):
    def epochs(persistent: bool) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        loader = DataLoader(Noisy(), batch_size=3, num_workers=2, persistent_workers=persistent)
        out = []
        for epoch in range(3):
            batches = []
            for batch in iterate_batches(loader):
                batches.append(batch)
                if abandon and epoch == 1:
                    break
            out.append(batches)
        return out

    fresh, persistent = epochs(False), epochs(True)
    assert [[b.tolist() for b in e] for e in persistent] == [[b.tolist() for b in e] for e in fresh]
