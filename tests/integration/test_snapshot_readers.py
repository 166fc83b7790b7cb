"""Projection snapshots written by a run and read back by load_result, inspect and replay.

A snapshot is a cache: every reader that starts from one must give exactly the answer of a
fold from 0; an unusable one is skipped with a note; replay compares each with its own fold.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from torch import nn

from events.log import LmdbLog
from nnx_es import Trainer, load_result
from nnx_es.runtime import recording as recorder
from nnx_es.audit import audit_run, project_log
from nnx_es.cli import inspect as inspect_cli
from nnx_es.result import result_of
from projections.snapshots import Snapshot, decode_snapshot, encode_snapshot
from projections.view import project
from trainkit import loaders, small_net

torch.set_num_threads(1)

EPOCHS = 5


def _fit(runs: Path, run_id: str, *, epochs: int = EPOCHS, resume_from: Path | None = None, **kw):
    net = small_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    trainer = Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau],
                      runs_root=runs, run_id=None if resume_from else run_id, seed=0, progress=False, **kw)
    return trainer.fit(*loaders(batch_size=8, n_train=32), epochs=epochs, resume_from=resume_from)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run with a snapshot at (nearly) every commit: SNAPSHOT_EVERY of a few events."""
    runs = tmp_path_factory.mktemp("snap")
    mp = pytest.MonkeyPatch()
    mp.setattr(recorder, "SNAPSHOT_EVERY", 5)
    try:
        _fit(runs, "r")
    finally:
        mp.undo()
    return runs / "r"


def _snapshots(run_dir: Path) -> list[tuple[int, bytes]]:
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return list(log.read_snapshots(newest_first=False))


def _full(run_dir: Path, stop: int | None = None):
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return project(log.read(0, stop))


def test_a_run_stores_snapshots_at_commits_each_equal_to_a_fold_from_zero(run):
    stored = _snapshots(run)
    assert len(stored) >= EPOCHS  # one at each epoch's commit at least (every 5 events)
    with LmdbLog(run / "events.lmdb", readonly=True) as log:
        kinds = {seq: e.KIND for seq, e in log.read()}
        for seq, value in stored:
            snap = decode_snapshot(seq, value)
            assert isinstance(snap, Snapshot)
            # at a commit: a LAST or the last event of its group
            assert kinds[seq] in {"last_committed", "best_committed", "checkpoint_stored", "callback_checkpointed",
                                  "phase_committed", "checkpoint_pruned"}
            assert msgspec.msgpack.encode(snap.projections) == msgspec.msgpack.encode(project(log.read(0, seq + 1)))


def test_readers_from_snapshots_equal_a_full_fold_at_every_seq(run):
    with LmdbLog(run / "events.lmdb", readonly=True) as log:
        n = log.next_seq
        starts = set()
        for stop in range(1, n + 1):
            got = project_log(log, stop)
            assert got.notes == []
            starts.add(got.start)
            assert msgspec.msgpack.encode(got.projections) == msgspec.msgpack.encode(project(log.read(0, stop))), stop
    assert len(starts) > EPOCHS  # the folds did start from snapshots
    full = _full(run)
    assert load_result(run) == result_of(full, run, n)


def test_inspect_at_and_summary_equal_the_full_fold(run, capsys):
    n = len(list(_full_pairs(run)))
    for seq in (0, n // 3, n // 2, n - 2, n - 1):
        assert inspect_cli.main([str(run), "--at", str(seq), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["projections"] == json.loads(msgspec.json.encode(_full(run, seq + 1)))
        assert doc["past_end"] is False
    assert inspect_cli.main([str(run), "--at", str(n + 40), "--json"]) == 0  # past the end: said, not silent
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["past_end"] is True and doc["events"] == n
    assert f"seq {n + 40} is past the log's end (its last event is seq {n - 1})" in captured.err
    assert doc["projections"] == json.loads(msgspec.json.encode(_full(run, n)))
    assert inspect_cli.main([str(run), "--at", str(n + 40)]) == 0
    assert capsys.readouterr().out.startswith(f"at seq {n + 40} (past the end: the log's last event is seq {n - 1}): ")
    assert inspect_cli.main([str(run), "summary", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "completed" and doc["epochs"] == EPOCHS and doc["checksums"] == "ok"


def _full_pairs(run_dir: Path):
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return list(log.read())


def test_replay_compares_every_snapshot_and_finds_the_run_clean(run):
    report = audit_run(run)
    assert report.ok, report.violations
    assert not [n for n in report.notes if "snapshot" in n]


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    dest = tmp_path / run.name
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("lock.mdb"))
    return dest


def _newest(run_dir: Path) -> tuple[int, bytes]:
    return _snapshots(run_dir)[-1]


def test_a_damaged_snapshot_is_ignored_with_a_note_by_readers_and_replay(run, tmp_path, capsys):
    run_dir = _copy(run, tmp_path)
    seq, value = _newest(run_dir)
    broken = value[:-1] + bytes([value[-1] ^ 0x01])
    with LmdbLog(run_dir / "events.lmdb") as log:
        log.put_snapshot_raw(seq, broken)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        got = project_log(log)
        assert got.start < seq + 1  # an older snapshot (or 0) was used
        assert got.notes == [f"the projection snapshot at seq {seq} is unusable (its checksum does not match its "
                             "bytes: a byte changed on disk): ignored, folded without it"]
        assert msgspec.msgpack.encode(got.projections) == msgspec.msgpack.encode(project(log.read()))
    assert inspect_cli.main([str(run_dir), "summary", "--json"]) == 0
    assert f"snapshot at seq {seq} is unusable" in capsys.readouterr().err
    report = audit_run(run_dir)
    assert report.ok, report.violations
    assert any(f"snapshot at seq {seq} is unusable" in n for n in report.notes)


def test_a_snapshot_that_verifies_but_holds_another_state_is_a_replay_violation(run, tmp_path):
    run_dir = _copy(run, tmp_path)
    seq, value = _newest(run_dir)
    snap = decode_snapshot(seq, value)
    assert isinstance(snap, Snapshot)
    p = snap.projections
    forged = msgspec.structs.replace(snap, projections=msgspec.structs.replace(
        p, counters=msgspec.structs.replace(p.counters, step=p.counters.step + 1)))
    with LmdbLog(run_dir / "events.lmdb") as log:
        log.put_snapshot_raw(seq, encode_snapshot(forged))
    report = audit_run(run_dir)
    assert [(v.seq, v.invariant) for v in report.violations] == [(seq, 9)]
    assert "counters" in report.violations[0].message


def test_a_snapshot_where_the_view_holds_events_back_is_a_replay_violation(run, tmp_path):
    run_dir = _copy(run, tmp_path)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        pairs = list(log.read())
    epoch_began = next(s for s, e in pairs if e.KIND == "epoch_began")
    mid = epoch_began + 2  # a microbatch: pending until its epoch's LAST
    forged = Snapshot(seq=mid, in_group=False, projections=_full(run_dir, mid + 1))
    with LmdbLog(run_dir / "events.lmdb") as log:
        log.put_snapshot_raw(mid, encode_snapshot(forged))
    report = audit_run(run_dir)
    assert [(v.seq, v.invariant) for v in report.violations] == [(mid, 9)]
    assert "holds events back" in report.violations[0].message


def test_a_log_without_snapshots_reads_as_before(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 0)
    result = _fit(tmp_path, "old", epochs=2)
    assert _snapshots(tmp_path / "old") == []
    with LmdbLog(tmp_path / "old" / "events.lmdb", readonly=True) as log:
        got = project_log(log)
        assert got.start == 0 and got.notes == []
    assert load_result(tmp_path / "old") == result
    assert audit_run(tmp_path / "old").ok


def test_a_resumed_run_continues_its_snapshots_from_the_newest(run, tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    run_dir = _copy(run, tmp_path)
    before = _snapshots(run_dir)
    _fit(run_dir.parent, "r", epochs=EPOCHS + 2, resume_from=run_dir)
    after = _snapshots(run_dir)
    assert after[: len(before)] == before and len(after) > len(before)
    assert audit_run(run_dir).ok
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        assert msgspec.msgpack.encode(project_log(log).projections) == msgspec.msgpack.encode(project(log.read()))


def test_a_snapshot_that_cannot_be_stored_never_fails_the_run(tmp_path, monkeypatch):
    from events.errors import EventLogError

    calls = []

    def failing(self, seq, value):
        calls.append(seq)
        raise EventLogError("no space left on device")

    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    monkeypatch.setattr(LmdbLog, "put_snapshot", failing)
    result = _fit(tmp_path, "nospace", epochs=3)
    assert result.status == "completed" and len(result.history) == 3
    assert len(calls) == 1  # turned off for the rest of the run after the first failure
    assert _snapshots(tmp_path / "nospace") == []
    assert audit_run(tmp_path / "nospace").ok


def _commits(run_dir: Path) -> tuple[list[int], list[int]]:
    """The epochs whose LAST was deferred (the next epoch's events before it) and those completed
    inline, the run's last epoch left out (no epoch follows it)."""
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        pairs = list(log.read())
    kinds = [e.KIND for _, e in pairs]
    lasts = [(seq, e) for seq, e in pairs if e.KIND == "last_committed" and e.epoch >= 0 and not e.final]
    deferred, inline = [], []
    for seq, e in lasts:
        if e.epoch < lasts[-1][1].epoch:
            (deferred if "epoch_began" in kinds[e.covers + 1:seq] else inline).append(e.epoch)
    return deferred, inline


def test_a_lagged_run_completes_a_commit_inline_where_a_snapshot_falls_due(tmp_path, monkeypatch):
    # a deferred LAST leaves the next epoch's events pending: with no point where the view holds
    # nothing back, a lagged run stored its only snapshot at its final commit
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 40)  # due every ~2 epochs of this run
    _fit(tmp_path, "lag", epochs=6, checkpoint_lag="epoch")
    run_dir = tmp_path / "lag"
    deferred, inline = _commits(run_dir)
    assert deferred and inline  # the lag still defers the commits where no snapshot is due
    stored = _snapshots(run_dir)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        final = max(s for s, e in log.read() if e.KIND == "last_committed")
        n = log.next_seq
        assert [s for s, _ in stored if s < final]  # snapshots mid-run, not only at the end
        for seq, value in stored:
            snap = decode_snapshot(seq, value)
            assert isinstance(snap, Snapshot)
            assert msgspec.msgpack.encode(snap.projections) == msgspec.msgpack.encode(project(log.read(0, seq + 1)))
        for stop in range(1, n + 1):
            got = project_log(log, stop)
            assert msgspec.msgpack.encode(got.projections) == msgspec.msgpack.encode(project(log.read(0, stop))), stop
    report = audit_run(run_dir)
    assert report.ok, report.violations


def test_a_lagged_run_without_snapshots_defers_every_epoch_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 0)
    _fit(tmp_path, "lag", epochs=4, checkpoint_lag="epoch")
    deferred, inline = _commits(tmp_path / "lag")
    assert deferred == [0, 1, 2] and inline == []
