"""Crash matrix of the history journal: SIGKILL between the chunk writes, the manifest and LAST.

At every persistence step of the last epoch's history step and commit (each chunk blob's write,
fsync and rename, the directory fsync, the manifest's, the log's synced commit -- before and
after each), a forked run is killed; then the run audits clean (replay verifies every committed
manifest and chunk), its readers show records up to LAST's epoch only, and a resume reaches the
uninterrupted run's records bitwise. The public harness (``nnx_es.testing.crash_test``) checks
the same run's every other guarantee at points spread over it.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import HistoryJournal, Trainer, read_rows, with_row_ids
from nnx_es.audit import audit_run
from nnx_es.injection import Point, install_kill, record_persistence, uninstall
from nnx_es.result import load_result
from nnx_es.testing import crash_test
from nnx_es.testing.harness import run_in_child
from trainkit import blobs_data, read_events, small_net

torch.set_num_threads(1)  # fork-safe parent

EPOCHS = 2


def _build(root, run_id="r"):
    x, y = blobs_data(40, 0)
    train = DataLoader(with_row_ids(TensorDataset(x[:28], y[:28])), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(1))
    val = DataLoader(with_row_ids(TensorDataset(x[28:], y[28:])), batch_size=6)
    net = small_net(0)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=root,
                      run_id=run_id, progress=False, history=HistoryJournal(window=1, chunk_rows=5))
    return trainer, train, val


def _fit(root, **kw):
    trainer, train, val = _build(root)
    return trainer.fit(train, val, epochs=EPOCHS, **kw)


def _columns(run_dir):
    return {k: v.tolist() for k, v in read_rows(run_dir).columns().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    rec = record_persistence()
    try:
        _fit(root)
    finally:
        uninstall()
    events = [e for _, e in read_events(root / "r")]
    # the last epoch's close: its history step writes the chunks, then the manifest, then LAST syncs
    start = max(i for i, e in enumerate(events) if e.KIND == "epoch_summarized")
    # before each os call: the state after the one before it (the last one's after, too)
    io = [i for i, at in enumerate(rec.storage_at) if at > start]
    points = [Point("io", i, "before") for i in io] + [Point("io", io[-1], "after")]
    points += [Point("sync", i, w) for i, at in enumerate(rec.sync_at) if at > start for w in ("before", "after")]
    return root / "r", points


def test_the_matrix_reaches_the_chunks_the_manifest_and_last(reference):
    _, points = reference
    kinds = {p.kind for p in points}
    # 9 chunks (28 train rows and 12 val rows of 5) and the manifest: write, fsync, rename each; 2 directory fsyncs
    assert kinds == {"io", "sync"} and len([p for p in points if p.kind == "io"]) >= 10 * 3 + 2


def test_a_kill_anywhere_in_the_journal_commit_leaves_records_up_to_last_and_resumes_exactly(reference, tmp_path):
    ref_dir, points = reference
    want = _columns(ref_dir)
    for point in points:
        root = tmp_path / str(point).replace(":", "_")
        outcome = run_in_child(lambda root=root, point=point: (install_kill(point), _fit(root)))
        assert outcome == "killed", f"{point}: {outcome}"
        run = root / "r"
        report = audit_run(run)
        assert report.ok, f"{point}: {[v.line() for v in report.violations]}"
        last = load_result(run).last
        assert last is not None
        assert read_rows(run).epochs == tuple(range(last.epoch + 1)), str(point)  # cut at LAST, the tail ignored
        outcome = run_in_child(lambda root=root: _fit(root, resume_from=root / "r"))
        assert outcome == "completed", f"{point}: resume {outcome}"
        assert _columns(run) == want, f"{point}: the resumed run's records differ from the uninterrupted run's"
        assert audit_run(run).ok, str(point)
        shutil.rmtree(root)


def test_the_public_harness_holds_for_a_journal_run(tmp_path):
    report = crash_test(lambda root, run_id: _build(root, run_id), epochs=EPOCHS, points=12, runs_root=tmp_path,
                        workers=1)
    assert report.ok, report
