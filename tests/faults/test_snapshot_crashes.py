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

from events.log import LmdbLog
from nnx_es.runtime import recording as recorder
from nnx_es.testing import Fit, crash_test
from trainkit import tiny_fit

torch.set_num_threads(1)


def build(runs_root, run_id) -> Fit:
    return tiny_fit(runs_root, run_id,
                    schedulers=lambda opt: [torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)])


def test_kills_around_every_snapshot_write_leave_a_resumable_run_and_a_clean_audit(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    fit = build(tmp_path, "probe")  # the cadence does write snapshots in this set-up
    fit.run(epochs=2)
    with LmdbLog(tmp_path / "probe" / "events.lmdb", readonly=True) as log:
        assert len(list(log.read_snapshots())) >= 2  # at both epochs' commits
    report = crash_test(build, epochs=2, points="all", runs_root=tmp_path)
    assert report.ok, report
    assert any(name.startswith("sync:") for name in report.tried)
