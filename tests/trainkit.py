"""Small deterministic training set-ups shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from events.log import LmdbLog
from events.schema import Event


def blobs_data(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A 3-class problem: x (n, 4) float32, y (n,) int64, separable by construction."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    centers = torch.tensor([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]])
    x = centers[y] + 0.3 * torch.randn(n, 4, generator=g)
    return x, y


def loaders(batch_size: int = 16, n_train: int = 48, n_val: int = 24, shuffle: bool = True, seed: int = 0):
    x, y = blobs_data(n_train + n_val, seed)
    train = DataLoader(
        TensorDataset(x[:n_train], y[:n_train]), batch_size=batch_size, shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed) if shuffle else None,
    )
    val = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=64)
    return train, val


def small_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def read_events(run_dir: str | Path) -> list[tuple[int, Event]]:
    with LmdbLog(Path(run_dir) / "events.lmdb", readonly=True) as log:
        return list(log.read())


def kinds(run_dir: str | Path) -> list[str]:
    return [e.KIND for _, e in read_events(run_dir)]


def params_of(net: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}
