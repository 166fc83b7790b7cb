"""SIGKILL around projection snapshot writes (the public harness, :func:`nnx_es.testing.crash_test`).

With a snapshot due at every commit (``SNAPSHOT_EVERY`` of a few events), a kill just before or
after a commit's sync, inside a blob write or before any event lands before, between or after
the snapshot writes; every such run must audit clean -- replay compares each snapshot the
killed run left with its own fold -- and resume to the uninterrupted run's final state bitwise
(the resumed run writing its own snapshots on from the newest one). The harness forks each
point from this process, so the patched cadence holds in every child.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from events.log import LmdbLog
from nnx_es import Trainer, recorder
from nnx_es.testing import Fit, crash_test

torch.set_num_threads(1)


def build(runs_root, run_id) -> Fit:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=g)
    y = (x[:, 0] > 0).long()
    net = nn.Sequential(nn.Linear(4, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss",
                      schedulers=[torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)],
                      runs_root=runs_root, run_id=run_id, seed=0, progress=False)
    return Fit(trainer, DataLoader(TensorDataset(x, y), batch_size=8),
               DataLoader(TensorDataset(x[:8], y[:8]), batch_size=8))


def test_kills_around_every_snapshot_write_leave_a_resumable_run_and_a_clean_audit(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    fit = build(tmp_path, "probe")  # the cadence does write snapshots in this set-up
    fit.run(epochs=2)
    with LmdbLog(tmp_path / "probe" / "events.lmdb", readonly=True) as log:
        assert len(list(log.read_snapshots())) >= 2  # at both epochs' commits
    report = crash_test(build, epochs=2, points="all", runs_root=tmp_path)
    assert report.ok, report
    assert any(name.startswith("sync:") for name in report.tried)
