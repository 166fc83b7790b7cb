"""Exact resume of a loader whose worker processes draw random augmentation.

torch seeds each worker from a base seed drawn when a loader iterator is created. With
``persistent_workers=True`` the iterator (and its workers' RNG streams) outlive the epoch,
so a resumed process, whose workers start afresh, would see other augmentation than the
uninterrupted run -- unless the workers are re-seeded each epoch as fresh ones would be.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from crashkit import kill_at_event, run_killed
from nnx_es import Trainer
from nnx_es.errors import ResumeError
from trainkit import blobs_data, read_events

torch.set_num_threads(1)  # fork-safe parent

EPOCHS = 4


class Augmented(Dataset):
    """Rows of ``x`` plus uniform noise drawn in ``__getitem__`` (in the worker that fetches it)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.rand(self.x.shape[1]), self.y[i]


def make_loader(persistent: bool) -> DataLoader:
    x, y = blobs_data(24, 0)
    return DataLoader(Augmented(x, y), batch_size=6, shuffle=True, num_workers=2, persistent_workers=persistent,
                      generator=torch.Generator().manual_seed(0))


def make_trainer(runs: Path, run_id: str | None) -> Trainer:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                   runs_root=runs, run_id=run_id, seed=0, progress=False)


def fit(runs: Path, run_id: str | None, persistent: bool, **kw) -> Trainer:
    trainer = make_trainer(runs, run_id)
    trainer.fit(make_loader(persistent), epochs=EPOCHS, **kw)
    return trainer


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh_workers", "persistent_workers"])
def test_resume_after_sigkill_with_augmenting_workers_is_bitwise_identical(persistent, tmp_path):
    reference = fit(tmp_path / "ref", "ref", persistent)
    kinds = [e.KIND for _, e in read_events(tmp_path / "ref" / "ref")]
    at = [i for i, k in enumerate(kinds) if k == "epoch_began"][2] + 2  # mid epoch 2, after epoch 1's LAST
    runs = tmp_path / "runs"
    assert run_killed(lambda: fit(runs, "r", persistent), kill_at_event(at)) == "killed"
    resumed = fit(runs, None, persistent, resume_from=runs / "r")
    for k, v in resumed.net.state_dict().items():
        assert torch.equal(v, reference.net.state_dict()[k]), k


def test_persistent_workers_train_bitwise_like_fresh_workers(tmp_path):
    fresh = fit(tmp_path, "fresh", False)
    persistent = fit(tmp_path, "persistent", True)
    for k, v in persistent.net.state_dict().items():
        assert torch.equal(v, fresh.net.state_dict()[k]), k


class Stream(IterableDataset):
    def __len__(self) -> int:
        return 24

    def __iter__(self):
        x, y = blobs_data(24, 0)
        info = torch.utils.data.get_worker_info()
        for i in range(info.id if info else 0, 24, info.num_workers if info else 1):
            yield x[i] + 0.1 * torch.rand(4), y[i]


def test_a_stateful_resume_with_persistent_workers_that_cannot_be_reseeded_is_refused(tmp_path):
    def stream_fit(**kw) -> None:
        trainer = make_trainer(tmp_path, "s")
        trainer.fit(DataLoader(Stream(), batch_size=6, num_workers=2, persistent_workers=True), epochs=1, **kw)

    stream_fit()
    before = read_events(tmp_path / "s")
    with pytest.raises(ResumeError, match=r"persistent_workers=True.*IterableDataset"):
        stream_fit(resume_from=tmp_path / "s")
    assert read_events(tmp_path / "s") == before
