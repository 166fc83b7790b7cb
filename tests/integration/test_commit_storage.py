"""Where a commit puts a checkpoint: a small model's manifest goes to the log with LAST, in one sync.

Counted, not timed: which fsyncs a run's epochs make (``os.fsync`` and the log's syncs, per
thread), which files it writes, and that runs whose manifests are files (written before they
moved to the log) still resume bitwise and audit clean.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from events.log import LmdbLog
from events.schema import CheckpointStored, LastCommitted
from nnx_es import Callback, Trainer
from nnx_es.audit import audit_run
from nnx_es.checkpoint import INLINE_MAX, read_manifest
from nnx_es.storage import BlobStore, atomic_write
from trainkit import EpochCounter, loaders, read_blob, read_events, small_net, write_blob

EPOCHS = 4


class Notes(EpochCounter):
    """A callback with state and checkpoint bytes of its own (small: they go to the log too)."""

    def checkpoint(self, ctx):
        return f"notes after epoch {ctx.epoch}".encode()


class Marks(Callback):
    """Reads the fsync counters at each epoch's start."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.at: dict[int, dict[str, int]] = {}

    def on_epoch_begin(self, ctx):
        self.at[ctx.epoch] = dict(self.counts)


def make_trainer(runs: Path, run_id: str | None, lag: int | str = 0, *callbacks: Callback) -> Trainer:
    net = small_net(0)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", callbacks=[Notes(), *callbacks],
                   runs_root=runs, run_id=run_id, seed=0, progress=False, checkpoint_lag=lag,
                   keep_last=None)  # every checkpoint kept: these tests count each commit's writes


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count ``os.fsync`` calls and synced log writes, on the training (main) thread and on others."""
    counts = {"file": 0, "log": 0, "other_threads": 0}
    main = threading.main_thread()
    real_fsync, real_flush = os.fsync, LmdbLog.flush

    def fsync(fd: int) -> None:
        counts["file" if threading.current_thread() is main else "other_threads"] += 1
        real_fsync(fd)

    def flush(self: LmdbLog, *, sync: bool = False) -> None:
        if sync:
            counts["log" if threading.current_thread() is main else "other_threads"] += 1
        real_flush(self, sync=sync)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(LmdbLog, "flush", flush)
    return counts


@pytest.mark.parametrize("lag", [0, "epoch"])
def test_a_small_models_epoch_commit_is_one_log_sync_and_writes_no_file(tmp_path, monkeypatch, lag):
    counts = _counting(monkeypatch)
    marks = Marks(counts)
    trainer = make_trainer(tmp_path / "runs", "r", lag, marks)
    run = trainer.fit(*loaders(), epochs=EPOCHS)
    # between the starts of epoch 1 and of the last epoch: whole epochs, each with its commit
    first, last = marks.at[1], marks.at[EPOCHS - 1]
    epochs = EPOCHS - 2
    assert (last["log"] - first["log"]) == epochs  # LAST, its manifest and the callback bytes: one sync
    assert last["file"] - first["file"] == 0 and last["other_threads"] - first["other_threads"] == 0
    run_dir = Path(run.run_dir)
    assert not (run_dir / "blobs").exists()  # every checkpoint of this model lives in the log
    events = read_events(run_dir)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        store = BlobStore(run_dir / "blobs", log=log)
        for seq, e in events:
            if isinstance(e, CheckpointStored):
                # the manifest is stored in the same write as the LAST naming it, the next event
                assert isinstance(events[seq + 1][1], LastCommitted) and events[seq + 1][1].manifest == e.manifest
                assert read_manifest(store, e.manifest).epoch == e.epoch
    assert audit_run(run_dir).ok
    # the trainer's store outlives its session's log: it reads manifests on its own
    assert read_manifest(trainer.store, run.last.manifest).epoch == run.last.epoch


def test_a_large_component_is_a_blob_file_durable_before_the_log_names_it(tmp_path, monkeypatch):
    counts = _counting(monkeypatch)
    marks = Marks(counts)
    trainer = make_trainer(tmp_path / "runs", "r", 0, marks)
    trainer.net.register_buffer("ballast", torch.arange(INLINE_MAX // 4 + 1, dtype=torch.float32))
    run = trainer.fit(*loaders(), epochs=EPOCHS)
    first, last = marks.at[1], marks.at[EPOCHS - 1]
    # per epoch: the model's blob file (its fsync, its directory's fsync), then the one log sync
    assert last["file"] - first["file"] == 2 * (EPOCHS - 2)
    assert last["log"] - first["log"] == EPOCHS - 2
    run_dir = Path(run.run_dir)
    files = {p.name for p in (run_dir / "blobs" / "sha256").iterdir()}
    store = BlobStore(run_dir / "blobs")
    for _, e in read_events(run_dir):
        if isinstance(e, CheckpointStored):
            assert e.manifest not in files and e.components["model"] in files
            assert read_manifest(store, e.manifest).components["model"].data is None
    assert audit_run(run_dir).ok


def test_a_run_whose_manifests_are_files_resumes_bitwise_and_audits_clean(tmp_path):
    """Runs written before manifests moved to the log keep them as files: still read, everywhere."""
    clean = make_trainer(tmp_path / "clean", "r")
    clean.fit(*loaders(), epochs=EPOCHS)
    runs = tmp_path / "runs"
    make_trainer(runs, "r").fit(*loaders(), epochs=2)
    run_dir = runs / "r"
    events = read_events(run_dir)
    moved = {e.manifest for _, e in events if isinstance(e, CheckpointStored)}
    moved |= {e.blob for _, e in events if e.KIND == "callback_checkpointed"}
    for digest in moved:  # as the earlier layout stored them: files, none in the log
        data = read_blob(run_dir, digest)
        atomic_write(BlobStore(run_dir / "blobs").path(digest), data)
        with LmdbLog(run_dir / "events.lmdb") as log:
            log.put_blob_raw(digest.encode(), None)
        assert read_blob(run_dir, digest) == data
    assert audit_run(run_dir).ok
    resumed = make_trainer(runs, None)
    resumed.fit(*loaders(), epochs=EPOCHS, resume_from=run_dir)
    for k, v in clean.net.state_dict().items():
        assert torch.equal(resumed.net.state_dict()[k], v), k
    report = audit_run(run_dir)
    assert report.ok, [v.line() for v in report.violations]
    # a damaged file manifest is still refused by the audit, naming it
    last = [e for _, e in read_events(run_dir) if isinstance(e, LastCommitted)][0]
    write_blob(run_dir, last.manifest, b"")
    assert not audit_run(run_dir).ok


def test_a_callback_loads_its_own_runs_best_and_audits_it_while_the_run_is_written(tmp_path):
    """Reading one's own live run in its process (restoring BEST at the end, auditing as it goes)
    shares the writer's log instead of failing to open it a second time."""
    from nnx_es import NNModel

    seen: list[tuple[int, int, bool]] = []

    class RestoreBest(Callback):
        def on_epoch_begin(self, ctx):
            if ctx.epoch > 0:  # BEST exists after epoch 0's commit
                probe = NNModel(small_net(1))
                seen.append((ctx.epoch, probe.load(ctx.trainer.run_dir, "best"), audit_run(ctx.trainer.run_dir).ok))

        def on_train_end(self, ctx):
            NNModel(ctx.trainer.net).load(ctx.trainer.run_dir, "best")  # the net ends on its BEST weights

    trainer = make_trainer(tmp_path / "runs", "r", 0, RestoreBest())
    run = trainer.fit(*loaders(), epochs=EPOCHS)
    assert [(e, ok) for e, _, ok in seen] == [(e, True) for e in range(1, EPOCHS)]
    assert all(0 <= best < e for e, best, _ in seen)
    from nnx_es.checkpoint import load_component, verify_checkpoint

    store = BlobStore(Path(run.run_dir) / "blobs")
    best = load_component(store, verify_checkpoint(store, run.best.manifest), "model")
    for k, v in best.items():
        assert torch.equal(trainer.net.state_dict()[k], v), k
    assert audit_run(Path(run.run_dir)).ok
