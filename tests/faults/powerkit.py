"""Set-ups of the power-loss tests, importable by the traced interpreter (module-level functions).

A model of ~69 k float32 parameters (≈275 KB, over ``INLINE_MAX``): its checkpoint parts and
Adam's state are blob *files* (temporary, fsync, rename, directory fsync), beside the log's own
blobs; a history journal adds chunk files each epoch; ``keep_last=1`` (the default) prunes the
previous LAST's files. The planted bugs patch the traced process from inside ``build``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import HistoryJournal, Trainer, with_row_ids
from nnx_es.testing import Fit


def wide_build(runs_root: Path, run_id: str, *, checkpoint_lag: Any = 0) -> Fit:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 512), nn.Tanh(), nn.Linear(512, 128), nn.Tanh(), nn.Linear(128, 2))
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=0.01), nn.CrossEntropyLoss(), monitor="val_loss",
                      runs_root=runs_root, run_id=run_id, seed=0, progress=False, checkpoint_lag=checkpoint_lag,
                      history=HistoryJournal(window=1, chunk_rows=8))
    train = DataLoader(with_row_ids(TensorDataset(x[:24], y[:24])), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    val = DataLoader(with_row_ids(TensorDataset(x[24:], y[24:])), batch_size=16)
    return Fit(trainer, train, val)


def lag_0(runs_root: Path, run_id: str) -> Fit:
    return wide_build(runs_root, run_id)


def lag_epoch(runs_root: Path, run_id: str) -> Fit:
    return wide_build(runs_root, run_id, checkpoint_lag="epoch")


def blob_renamed_without_directory_fsync(runs_root: Path, run_id: str) -> Fit:
    """Planted: ``fsync_dir`` does nothing, so a blob's rename may not survive the cut that LAST does."""
    import nnx_es.storage

    nnx_es.storage.fsync_dir = lambda path: None
    return wide_build(runs_root, run_id)


class _FilesNotSynced:
    """Stands in for ``nnx_es.storage.os``: the real module, except that ``fsync`` of a regular file
    does nothing (a directory's still syncs)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.fsync(fd)


def last_synced_before_its_blobs(runs_root: Path, run_id: str) -> Fit:
    """Planted: blob files are renamed into place unsynced, so LAST's sync may reach the disk before
    their bytes do."""
    import nnx_es.storage

    nnx_es.storage.os = _FilesNotSynced()  # type: ignore[assignment]
    return wide_build(runs_root, run_id)


def small_build(runs_root: Path, run_id: str) -> Fit:
    """A model small enough that every blob is a value of the log: every persistence point is LMDB's,
    and the log's unsynced flushes between commits (6 batches an epoch) get the whole budget."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=0.05), nn.CrossEntropyLoss(), monitor="val_loss",
                      runs_root=runs_root, run_id=run_id, seed=0, progress=False)
    train = DataLoader(TensorDataset(x[:48], y[:48]), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    return Fit(trainer, train, DataLoader(TensorDataset(x[48:], y[48:]), batch_size=16))


def old_lmdb_flags(runs_root: Path, run_id: str) -> Fit:
    """Planted: the log's LMDB flags until 2026-12-03 (MDB_NOSYNC; ``env.sync`` only at commits)."""
    import events.lmdbenv

    events.lmdbenv.DURABILITY.update(sync=False, metasync=True)
    return small_build(runs_root, run_id)
