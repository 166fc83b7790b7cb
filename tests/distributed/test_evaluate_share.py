"""Outside a process group, NNModel.evaluate refuses a loader that is one rank's share of several:
its metrics would be that share's (found in review, issue 13; inside a group they are agreed)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ddpkit
from nnx_es import NNModel
from nnx_es.distributed import train_loader, validation_loader
from nnx_es.errors import ConfigError


@pytest.mark.parametrize("kind", ["validation_loader", "train_loader", "DistributedSampler"])
def test_one_ranks_share_is_refused_outside_a_group(kind: str) -> None:
    data = ddpkit.dataset()
    loader = {"validation_loader": lambda: validation_loader(data, 4, rank=1, world_size=2),
              "train_loader": lambda: train_loader(data, 4, rank=1, world_size=2),
              "DistributedSampler": lambda: DataLoader(data, batch_size=4,
                                                       sampler=DistributedSampler(data, num_replicas=2, rank=1))}[kind]()
    model = NNModel(ddpkit.net())
    with pytest.raises(ConfigError, match="rank 1's share of 2 ranks") as err:
        model.evaluate(loader, loss=torch.nn.CrossEntropyLoss(), sample_weights=True)
    assert "evaluate on every rank inside the group" in str(err.value)


def test_a_whole_loader_and_a_one_rank_shard_evaluate_outside_a_group() -> None:
    data = ddpkit.dataset()
    model = NNModel(ddpkit.net())
    whole = model.evaluate(DataLoader(data, 24), loss=torch.nn.CrossEntropyLoss(), sample_weights=True)
    alone = model.evaluate(validation_loader(data, 5, rank=0, world_size=1), loss=torch.nn.CrossEntropyLoss(),
                           sample_weights=True)
    assert alone == pytest.approx(whole, rel=1e-6)
