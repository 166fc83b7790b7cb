"""Small deterministic training set-ups shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from events.log import LmdbLog
from nnx_es.callbacks import Callback
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


# --- helpers of the update-engine, clock/monitor and stage tests --------------------------


def batches(sizes: list[int], seed: int = 0, *, masks: dict[int, list[float]] | None = None,
            nan_at: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, ...]]:
    """A plain list of microbatches of the given row counts, cut from :func:`blobs_data`.

    masks: microbatch index -> per-row weights; when given, every batch is ``(x, y, w)``
    (weights 1 where not listed). nan_at: microbatch indices whose first input row is NaN.
    """
    x, y = blobs_data(sum(sizes), seed)
    out: list[tuple[torch.Tensor, ...]] = []
    start = 0
    for i, n in enumerate(sizes):
        xb, yb = x[start:start + n].clone(), y[start:start + n].clone()
        start += n
        if i in nan_at:
            xb[0, 0] = float("nan")
        if masks is not None:
            w = torch.tensor(masks[i], dtype=torch.float32) if i in masks else torch.ones(n)
            out.append((xb, yb, w))
        else:
            out.append((xb, yb))
    return out


def of_kind(run_dir: str | Path, kind: str) -> list[Any]:
    """The events of one kind, in log order."""
    return [e for _, e in read_events(run_dir) if e.KIND == kind]


def logit_for_loss(value: float) -> float:
    """z such that cross_entropy(logits [0, z], target 0) = log(1 + e^z) equals ``value`` (> 0)."""
    import math

    return math.log(math.expm1(value))


def designed_outputs(value: float, rows: int, like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """2-class logits ``[0, z]`` (rows, 2) and targets 0 (rows,) whose mean CE is ``value``.

    ``like``: a grad-carrying tensor (rows, >=2) mixed in with weight 0, so the loss
    can be backpropagated while its value stays the designed one.
    """
    z = torch.full((rows,), logit_for_loss(value))
    logits = torch.stack([torch.zeros(rows), z], dim=1)
    if like is not None:
        logits = logits + 0.0 * like[:, :2]
    return logits, torch.zeros(rows, dtype=torch.long)


class EpochCurve:
    """A ``train_step_fn``/``eval_step_fn`` whose cross-entropy is designed, not learned.

    values[epoch] is the loss of every row in that epoch, or a list indexed by the
    microbatch's index in the epoch. The epoch is read from the trainer's context:
    set ``curve.trainer`` after constructing the Trainer. When autograd is on, the
    net's output is mixed in with weight 0, so a backward pass runs and leaves every
    gradient at 0.
    """

    def __init__(self, values: list[Any]) -> None:
        self.values = values
        self.trainer: Any = None

    def __call__(self, net: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
        ctx = self.trainer.ctx
        value = self.values[ctx.epoch]
        if isinstance(value, (list, tuple)):
            value = value[ctx.batch_index]
        x = batch[0]
        like = net(x) if torch.is_grad_enabled() else None
        logits, targets = designed_outputs(float(value), len(x), like)
        return logits, targets, None


class EpochCounter(Callback):
    """A callback with checkpointed state (its epoch count); ``on_epoch_begin`` optionally calls a function."""

    def __init__(self, on_epoch_begin: Any = None) -> None:
        self.epochs = 0
        self._begin = on_epoch_begin

    def on_epoch_begin(self, ctx):
        if self._begin is not None:
            self._begin(ctx)

    def on_epoch_end(self, ctx):
        self.epochs += 1

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


def read_blob(run_dir: str | Path, digest: str) -> bytes | None:
    """A blob's stored bytes, unverified, wherever it is (a file, or the log's blobs); None when absent."""
    path = Path(run_dir) / "blobs" / "sha256" / digest
    if path.exists():
        return path.read_bytes()
    with LmdbLog(Path(run_dir) / "events.lmdb", readonly=True) as log:
        return log.get_blob(digest.encode())


def write_blob(run_dir: str | Path, digest: str, data: bytes | None) -> None:
    """Damage a stored blob where it is: replace its bytes with ``data``, or delete it (``None``)."""
    path = Path(run_dir) / "blobs" / "sha256" / digest
    if path.exists():
        path.unlink() if data is None else path.write_bytes(data)
        return
    with LmdbLog(Path(run_dir) / "events.lmdb") as log:
        assert log.get_blob(digest.encode()) is not None, f"blob {digest} is stored nowhere"
        log.put_blob_raw(digest.encode(), data)


def tiny_fit(runs_root: str | Path, run_id: str, schedulers: Any = None, **trainer_kw: Any) -> Any:
    """A 24-row, 3-batch binary run with a val_loss monitor, seeded: the crash tests' small set-up
    (an :class:`nnx_es.testing.Fit`). ``schedulers``: a function of the optimizer returning the run's
    schedulers; ``trainer_kw``: the rest of ``Trainer``'s arguments (callbacks, checkpoint_lag, ...)."""
    from nnx_es import Trainer
    from nnx_es.testing import Fit

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=g)
    y = (x[:, 0] > 0).long()
    net = nn.Sequential(nn.Linear(4, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if schedulers is not None:
        trainer_kw["schedulers"] = schedulers(opt)
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", runs_root=runs_root, run_id=run_id,
                      seed=0, progress=False, **trainer_kw)
    return Fit(trainer, DataLoader(TensorDataset(x, y), batch_size=8),
               DataLoader(TensorDataset(x[:8], y[:8]), batch_size=8))
