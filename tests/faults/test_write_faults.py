"""Write faults: ENOSPC and EIO at every kind of durable write a run makes.

Sites: the write of a blob's temporary (``os.write`` in :func:`nnx_es.storage.atomic_write_all`),
its fsync, the directory fsync (:func:`nnx_es.storage.fsync_dir`), the LMDB commit of the
log (the write transaction, or the environment sync after it) and the rename of a view
file. Each fault is injected once (the disk recovers) at a chosen moment of a 3-epoch run:

* *before LAST*: while epoch 1 commits. The error reaches the caller; the epoch's history
  is rolled back (the committed view is the one after epoch 0); the run is ``failed``.
* *after LAST*: at finalization (the final LAST refresh, the ``run_finalized`` commit, the
  view files). The durable history/LAST pair of the last epoch stays.

After every fault: the audit holds, LAST verifies, no temporary file is left in the run
directory, and a resume reaches the uninterrupted run's final parameters bitwise.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import pytest
import torch
from torch import nn

from crashkit import LmdbFaults, install_storage_hook, uninstall_storage_hook
from events.errors import EventLogError
from nnx_es import Callback, Trainer
from nnx_es.audit import audit_run
from nnx_es.checkpoint import INLINE_MAX, verify_checkpoint
from nnx_es.errors import CheckpointWriteError
from nnx_es.storage import BlobStore
from projections import Projections, project
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)

EPOCHS = 3
FAULT_EPOCH = 1
RUN_ID = "r"
ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO}


class Arm:
    """Where a fault fires: which seam, when it is armed, and what it raises."""

    def __init__(self, site: str, stage: str, code: int, skip: int = 0) -> None:
        self.site, self.stage, self.code, self.skip = site, stage, code, skip
        self.armed = False
        self.fired: list[str] = []
        self.lmdb = LmdbFaults()

    def arm(self) -> None:
        self.armed = True
        if self.site == "lmdb_commit":
            self.lmdb.commit_errno, self.lmdb.skip = self.code, self.skip
        elif self.site == "lmdb_sync":
            self.lmdb.sync_errno, self.lmdb.skip = self.code, self.skip

    # the storage seam: (op, caller) of the call that fails, and a path filter
    _STORAGE = {
        "blob_write": ("write", "atomic_write_all"),
        "file_fsync": ("fsync", "atomic_write_all"),
        "dir_fsync": ("fsync", "fsync_dir"),
        "view_replace": ("replace", "atomic_write_all"),
    }

    def storage_hook(self, op: str, caller: str, index: int, when: str, args: tuple[Any, ...]) -> None:
        if not self.armed or when != "before" or self._STORAGE.get(self.site) != (op, caller):
            return
        if self.site == "view_replace" and "views" not in str(args[1]):
            return
        self.armed = False
        self.fired.append(f"{op} ({caller})")
        raise OSError(self.code, os.strerror(self.code))


class Tally(Callback):
    """State that changes every update and at finalization; its own checkpoint bytes each epoch.

    Arms the fault at the end of :data:`FAULT_EPOCH` (before that epoch's commit) or at
    ``on_train_end`` (before the final LAST refresh).
    """

    def __init__(self, arm: Arm | None = None) -> None:
        self.arm = arm
        self.updates = 0
        self.finalized = 0

    def on_optimizer_update(self, ctx, receipt):
        self.updates += 1

    def on_epoch_end(self, ctx):
        if self.arm is not None and self.arm.stage == "before_last" and ctx.epoch == FAULT_EPOCH:
            self.arm.arm()

    def on_train_end(self, ctx):
        self.finalized += 1
        if self.arm is not None and self.arm.stage == "after_last":
            self.arm.arm()

    def state_dict(self):
        # padded above INLINE_MAX: a blob file of its own in every checkpoint, the final refresh's too
        # (a small state would live in the manifest, which goes to the log: no file to fault)
        return {"updates": self.updates, "finalized": self.finalized, "pad": bytes(INLINE_MAX)}

    def load_state_dict(self, state):
        self.updates, self.finalized = state["updates"], state["finalized"]

    def checkpoint(self, ctx):
        return f"tally epoch={ctx.epoch} updates={self.updates}".encode()


def make_trainer(runs: Path, run_id: str | None, arm: Arm | None = None) -> Trainer:
    net = small_net(0)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    return Trainer(
        net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau], callbacks=[Tally(arm)],
        accumulation=2, phase_every=1, keep_phases=2, runs_root=runs, run_id=run_id, seed=0, progress=False,
    )


def fit(trainer: Trainer, **kw: Any):
    return trainer.fit(*loaders(batch_size=8, n_train=32, n_val=24), epochs=EPOCHS, **kw)


def _state(p: Projections) -> dict[str, Any]:
    """The committed view, wall-clock fields aside (status compared separately)."""
    return {
        "history": [msgspec.structs.replace(r, wall_time_s=0.0) for r in p.history.records],
        "last": p.checkpoints.last,
        "best": p.checkpoints.best,
        "phases": p.checkpoints.phases,
        "callbacks": p.checkpoints.callbacks,
        "counters": p.counters,
        "schedulers": p.schedulers,
    }


def _temporaries(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*.tmp"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    runs = tmp_path_factory.mktemp("reference")
    trainer = make_trainer(runs, RUN_ID)
    run = fit(trainer)
    events = read_events(run.run_dir)
    kinds = [e.KIND for _, e in events]
    # the committed view after epoch FAULT_EPOCH - 1 (its whole commit group), and after the last epoch
    epoch_starts = [s for s, e in events if e.KIND == "epoch_began"]
    first_finalized = kinds.index("callback_finalized")
    return {
        "params": {k: v.clone() for k, v in trainer.net.state_dict().items()},
        "before": _state(project(events[: epoch_starts[FAULT_EPOCH]])),
        "trained": _state(project(events[:first_finalized])),
        "final": _state(project(events)),
        "syncs": trainer.recorder.log.syncs,
    }


@pytest.fixture
def lmdb_open(monkeypatch):
    """Route ``lmdb.open`` through an :class:`Arm`'s fault injector (set by the test)."""
    holder: dict[str, Arm] = {}
    real_open = lmdb.open

    def open_(*args: Any, **kwargs: Any) -> Any:
        return holder["arm"].lmdb.open(*args, **kwargs) if "arm" in holder else real_open(*args, **kwargs)

    monkeypatch.setattr(lmdb, "open", open_)
    return holder


@pytest.fixture
def storage_faults():
    """Route ``nnx_es.storage``'s os calls through an :class:`Arm`'s hook (set by the test)."""
    holder: dict[str, Arm] = {}
    install_storage_hook(lambda *a: holder["arm"].storage_hook(*a) if "arm" in holder else None)
    yield holder
    uninstall_storage_hook()


# site -> (stage, error type, what the message names, committed view expected, status expected)
CASES: dict[str, tuple[str, type[Exception], str, str, str]] = {
    "blob_write": ("before_last", CheckpointWriteError, "writing ", "before", "failed"),
    "file_fsync": ("before_last", CheckpointWriteError, "writing ", "before", "failed"),
    "dir_fsync": ("before_last", CheckpointWriteError, "writing ", "before", "failed"),
    "lmdb_commit": ("before_last", EventLogError, "mdb_txn_commit", "before", "failed"),
    "lmdb_sync": ("before_last", EventLogError, "mdb_env_sync", "before", "failed"),
    "final_blob_write": ("after_last", CheckpointWriteError, "writing ", "trained", "failed"),
    "final_lmdb_commit": ("after_last", EventLogError, "mdb_txn_commit", "trained", "failed"),
    "final_lmdb_sync": ("after_last", EventLogError, "mdb_env_sync", "trained", "failed"),
    "run_finalized_commit": ("after_last", EventLogError, "mdb_txn_commit", "final", "running"),
    "view_replace": ("after_last", CheckpointWriteError, "views/history.csv", "final", "completed"),
}
# case -> (seam, LMDB write transactions that pass first): at finalization the callbacks'
# records are written first (one transaction), then the final LAST, then run_finalized
_SEAM = {
    "final_blob_write": ("blob_write", 0),
    "final_lmdb_commit": ("lmdb_commit", 1),
    "final_lmdb_sync": ("lmdb_sync", 0),
    "run_finalized_commit": ("lmdb_commit", 2),
}


@pytest.mark.parametrize("code_name", sorted(ERRNOS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_write_fault_reaches_the_caller_and_keeps_the_committed_state(
    case, code_name, reference, tmp_path, lmdb_open, storage_faults
):
    stage, error_type, names, expected_view, expected_status = CASES[case]
    code = ERRNOS[code_name]
    seam, skip = _SEAM.get(case, (case, 0))
    arm = Arm(seam, stage, code, skip)
    lmdb_open["arm"] = arm
    storage_faults["arm"] = arm
    runs = tmp_path / "runs"
    run_dir = runs / RUN_ID
    with pytest.raises(error_type) as info:
        fit(make_trainer(runs, RUN_ID, arm))
    # the fault fired exactly once, where it was meant to
    assert len(arm.fired) + len(arm.lmdb.injected) == 1, (arm.fired, arm.lmdb.injected)
    # a clear error naming the failure (errno text and what was being written)
    message = str(info.value)
    assert os.strerror(code) in message and names in message, message
    if isinstance(info.value, CheckpointWriteError):
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == code
    # the committed state: rolled back to before the epoch, or the durable history/LAST pair kept
    p = project(read_events(run_dir))
    assert _state(p) == reference[expected_view]
    assert p.status.status == expected_status
    if expected_status == "failed":
        assert p.status.error_type == error_type.__name__ and os.strerror(code) in (p.status.error or "")
    verify_checkpoint(BlobStore(run_dir / "blobs"), p.checkpoints.last.manifest, run_id=RUN_ID)
    assert _temporaries(run_dir) == []
    report = audit_run(run_dir)
    assert report.ok, [v.line() for v in report.violations]
    # the disk recovered: the run resumes to the uninterrupted run's parameters, bitwise
    lmdb_open.clear()
    storage_faults.clear()
    trainer = make_trainer(runs, None)
    resumed = fit(trainer, resume_from=run_dir)
    assert resumed.status == "completed"
    for name, value in trainer.net.state_dict().items():
        assert torch.equal(value, reference["params"][name]), name
    assert _state(project(read_events(run_dir)))["history"] == reference["final"]["history"]
    report = audit_run(run_dir)
    assert report.ok, [v.line() for v in report.violations]


def test_a_disk_that_stays_full_fails_the_run_once_and_leaves_no_temporary(reference, tmp_path, storage_faults):
    """ENOSPC on every blob and view write from epoch 1's commit on: the first error surfaces,
    the run is recorded failed with epoch 0's commit intact, and nothing half-written remains."""

    class Full(Arm):
        def storage_hook(self, op, caller, index, when, args):
            if self.armed and when == "before" and op == "write":
                self.fired.append(str(index))
                raise OSError(self.code, os.strerror(self.code))

    arm = Full("blob_write", "before_last", errno.ENOSPC)
    storage_faults["arm"] = arm
    runs = tmp_path / "runs"
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        fit(make_trainer(runs, RUN_ID, arm))
    assert len(arm.fired) >= 1
    run_dir = runs / RUN_ID
    p = project(read_events(run_dir))
    assert _state(p) == reference["before"]
    assert p.status.status == "failed" and p.status.error_type == "CheckpointWriteError"
    assert _temporaries(run_dir) == []
    assert not (run_dir / "views" / "history.csv").exists()  # the view write failed too, and left nothing
    assert audit_run(run_dir).ok
