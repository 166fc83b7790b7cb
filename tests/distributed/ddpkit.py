"""The set-ups the distributed scenarios train, shared by the ranks (scenarios.py) and the
single-process references the tests compute (the union of the ranks' batches)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nnx_es.distributed import partition_indices

N_ROWS = 24
BATCH = 5  # per rank: 12 rows per rank -> batches of 5, 5, 2 (a short last batch)
ACCUMULATION = 2  # windows of 2, 1 microbatches: the trailing window's backward runs under no_sync
SEED = 3


def dataset(n: int = N_ROWS) -> TensorDataset:
    """x (n, 5) float32, y (n,) int64 in 0..2, weights (n,) with zeros: ranks hold unequal valid counts."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    w = torch.ones(n)
    w[torch.tensor([1, 3, 4, 9, 17])] = 0.0  # masked rows
    w[torch.tensor([2, 6])] = 2.5
    return TensorDataset(x, y, w)


def ignored_data(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, 5), y (n,) class ids with ignore_index (-100) targets, more on even rows (rank 0 under
    ``train_loader(..., shuffle=False)``) than odd; batch 2 of rows 0-3 is ignored on rank 0 only."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    y[torch.tensor([0, 2, 6, 8, 9, 14])] = -100
    return x, y


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def dropout_net(seed: int = 0) -> nn.Module:
    """``net`` with dropout (p = 0.5) between its layers: a forward drawing from the global torch stream."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Dropout(0.5), nn.Linear(7, 3))


def trainer(model: nn.Module, *, runs_root: Path, run_id: str, distributed: Any = None, **kw: Any):
    from nnx_es import Scheduler, Trainer

    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    upd = Scheduler(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s)), clock="optimizer_update",
                    name="decay")
    ep = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), name="step")
    kw.setdefault("accumulation", ACCUMULATION)
    return Trainer(model, opt, nn.CrossEntropyLoss(), sample_weights=True, schedulers=[upd, ep],
                   runs_root=runs_root, run_id=run_id, distributed=distributed, progress=False, **kw)


class UnionLoader:
    """The single-process reference: batch i of epoch e is rank 0's batch i followed by rank 1's."""

    def __init__(self, data: TensorDataset, batch: int = BATCH, world: int = 2, seed: int = SEED) -> None:
        self.data, self.batch, self.world, self.seed = data, batch, world, seed
        self.sampler = self  # the loop calls sampler.set_epoch(epoch)
        self.epoch = 0
        self.batch_size = batch * world

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _parts(self) -> list[list[int]]:
        return [partition_indices(len(self.data), rank=r, world_size=self.world, epoch=self.epoch, seed=self.seed)
                for r in range(self.world)]

    def __len__(self) -> int:
        return -(-len(self._parts()[0]) // self.batch)

    def __iter__(self):
        parts = self._parts()
        for i in range(len(self)):
            idx = [j for p in parts for j in p[i * self.batch:(i + 1) * self.batch]]
            yield tuple(t[idx] for t in self.data.tensors)


def params(model: nn.Module) -> dict[str, list]:
    return {k: v.detach().double().flatten().tolist() for k, v in model.state_dict().items()}


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def receipts(run_dir: Path) -> list[dict[str, Any]]:
    from events.log import LmdbLog

    with LmdbLog(Path(run_dir) / "events.lmdb", readonly=True) as log:
        return [{"kind": e.KIND, "step": getattr(e, "step", None), "lrs": list(getattr(e, "lrs", []) or []),
                 "global": getattr(e, "global_examples", None), "local": getattr(e, "local_examples", None),
                 "loss": getattr(e, "loss", None), "reason": getattr(e, "reason", None),
                 "bytes": getattr(e, "collective_bytes", None)}
                for _, e in log.read(kinds=("update_committed", "update_skipped"))]
