"""The resume point of a long run is found without holding its log (issue 14).

``find_resume_point`` reads the log as a stream and folds the committed view from the newest
usable projection snapshot. These tests hold it to the whole-log algorithm it replaced
(:func:`whole_log_point`, kept here as the oracle: the whole log in a list, the committed view
folded from seq 0), at every kill point of runs whose snapshots are due at every commit --
deferred LASTs and early stops included -- and check that it folds only the events after the
snapshot and that its memory does not grow with the log.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import msgspec
import pytest
import torch

from bench.logbench import long_run_log
from events import keys
from events.log import LmdbLog
from events.schema import LastCommitted
from nnx_es import EarlyStopping, load_result, resume
from nnx_es.runtime import recording as recorder
from nnx_es.runtime import session
from nnx_es.audit import audit_run
from nnx_es.errors import ResumeError
from nnx_es.lifecycle import compiled_table
from nnx_es.testing import Fit, crash_test
from trainkit import tiny_fit
from projections.commits import GroupTracker
from projections.view import Projections, committed, fold

torch.set_num_threads(1)


def whole_log_point(log: LmdbLog) -> tuple[str, int, int, Projections]:
    """(lifecycle state, LAST's seq, discard_from, projections) as the whole-log algorithm found them."""
    events = list(log.read())
    table, state, group, boundary = compiled_table(), "new", GroupTracker(), -1
    for seq, event in events:
        state = table.get((state, event.KIND), state)
        if group.see(event.KIND) or event.KIND == "run_resumed":
            boundary = seq
    kept: set[int] = set()
    proj, last = Projections(), -1
    for seq, event in committed(events):
        if seq > boundary:
            break
        kept.add(seq)
        proj = fold(proj, seq, event)
        if isinstance(event, LastCommitted):
            last = seq
    since = max((s for s, e in events if e.KIND == "run_resumed" and s <= boundary), default=-1)
    discard_from = next((s for s, _ in events if since < s <= boundary and s not in kept), boundary + 1)
    return state, last, discard_from, proj


def checking_resume(monkeypatch: pytest.MonkeyPatch, calls: Path, every: int) -> None:
    """Make every resume compare its point with :func:`whole_log_point`'s (a difference fails the
    resume, so the crash harness reports it) and note in ``calls`` whether a snapshot was there."""
    streaming = session.find_resume_point

    def checked(run_dir: Path, log: LmdbLog, **kw: object) -> resume.ResumePoint:
        point = streaming(run_dir, log, **kw)
        expected = whole_log_point(log)
        found = (point.state, point.last_seq, point.discard_from, point.projections)
        assert found == expected, f"streaming {found} != whole log {expected}"
        with calls.open("a") as f:
            f.write(f"{'snapshot' if any(True for _ in log.read_snapshots(point.last_seq + 1)) else 'none'}\n")
        return point

    monkeypatch.setattr(session, "find_resume_point", checked)
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", every)


def build(lag: int | str, patience: int | None):
    def make(runs_root, run_id) -> Fit:
        callbacks = [EarlyStopping(patience=patience)] if patience is not None else []
        return tiny_fit(runs_root, run_id, callbacks=callbacks, checkpoint_lag=lag)
    return make


# a seeded sample of kill points; with a lag, pending events leave gaps (a snapshot due every
# ~2 epochs completes that commit inline)
@pytest.mark.parametrize(("lag", "patience", "epochs", "points", "every"),
                         [(0, None, 2, 30, 5), ("epoch", None, 4, 40, 40), (0, 1, 6, 30, 5)],
                         ids=["lag-0", "deferred-LAST", "early-stop"])
def test_resume_point_from_a_snapshot_equals_the_whole_log_fold_at_kill_points(tmp_path, monkeypatch, lag, patience,
                                                                              epochs, points, every):
    calls = tmp_path / "calls.txt"
    checking_resume(monkeypatch, calls, every)
    report = crash_test(build(lag, patience), epochs=epochs, points=points, runs_root=tmp_path / "runs")
    assert report.ok, report
    seen = calls.read_text().split()
    assert len(seen) >= len(report.tried) // 2  # most kill points leave a LAST to resume from
    assert seen.count("snapshot") >= len(seen) // 4  # many of those resumes start from a snapshot


def test_resume_folds_only_the_events_after_the_newest_snapshot(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    build(0, None)(tmp_path, "r").run(epochs=3)
    folded: list[int] = []

    def counting(state: Projections, seq: int, event: object) -> Projections:
        folded.append(seq)
        return fold(state, seq, event)  # type: ignore[arg-type]

    monkeypatch.setattr(resume, "fold", counting)
    with LmdbLog(tmp_path / "r" / "events.lmdb", readonly=True) as log:
        point = resume.find_resume_point(tmp_path / "r", log)
        newest = max(seq for seq, _ in log.read_snapshots())
        assert (point.state, point.last_seq, point.discard_from, point.projections) == whole_log_point(log)
        n = log.next_seq
    assert 0 < newest < n - 1
    assert folded and min(folded) > newest  # nothing at or before the snapshot is folded again
    assert len(folded) <= n - 1 - newest


def test_a_damaged_snapshot_is_skipped_and_the_resume_point_is_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    build(0, None)(tmp_path, "r").run(epochs=3)
    with LmdbLog(tmp_path / "r" / "events.lmdb") as log:
        stored = list(log.read_snapshots())
        newest, value = stored[0]
        log.put_snapshot_raw(newest, value[:4] + bytes([value[4] ^ 0xFF]) + value[5:])
        point = resume.find_resume_point(tmp_path / "r", log)
        assert (point.state, point.last_seq, point.discard_from, point.projections) == whole_log_point(log)


def test_a_snapshot_that_verifies_but_disagrees_with_the_log_lasts_is_not_trusted(tmp_path, monkeypatch):
    # found in review: a snapshot whose checksum verifies but whose state is an older point's (a
    # writer's bug, a copy under the wrong key) was trusted: the resume lost the epochs between,
    # wrote them into its own snapshots and views, and only tools/replay saw it
    from projections.snapshots import Snapshot, decode_snapshot, encode_snapshot

    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    torch.manual_seed(0)
    build(0, None)(tmp_path, "r").run(epochs=3)
    with LmdbLog(tmp_path / "r" / "events.lmdb") as log:
        (newest, _), (_, older) = list(log.read_snapshots())[:2]
        stale = decode_snapshot(next(s for s, v in log.read_snapshots() if v == older), older)
        assert isinstance(stale, Snapshot) and stale.projections.checkpoints.commits > 0
        log.put_snapshot_raw(newest, encode_snapshot(msgspec.structs.replace(stale, seq=newest)))
        point = resume.find_resume_point(tmp_path / "r", log)
        assert (point.state, point.last_seq, point.discard_from, point.projections) == whole_log_point(log)
    # the resumed session's own snapshots and views start where the resume did, not from the stale one
    resumed = build(0, None)(tmp_path, "r").run(epochs=5, resume_from=tmp_path / "r")
    torch.manual_seed(0)
    build(0, None)(tmp_path, "whole").run(epochs=5)
    strip = [msgspec.structs.replace(h, wall_time_s=0.0) for h in resumed.history]
    assert strip == [msgspec.structs.replace(h, wall_time_s=0.0) for h in load_result(tmp_path / "whole").history]
    assert [msgspec.structs.replace(h, wall_time_s=0.0) for h in load_result(tmp_path / "r").history] == strip
    violations = audit_run(tmp_path / "r").violations
    assert [v.seq for v in violations] == [newest]  # the forged snapshot itself, and nothing it led to


def _peak_bytes(run_dir: Path) -> int:
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        tracemalloc.start()
        try:
            with pytest.raises(ResumeError, match="manifest"):  # the bench log stores no blob
                resume.find_resume_point(run_dir, log)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


def test_finding_the_resume_point_of_a_4x_longer_run_takes_no_more_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(keys, "_BLOCK", 1024)  # the key check's block (65,536 keys) within these small logs
    # 4x the epochs of the same size: a whole-log read would hold 4x the events; what is held
    # now is a write batch's values (the checksums) and the events pending in the committed view
    # (each at most an epoch), and the projections (a history record an epoch)
    short, long_ = tmp_path / "short" / "r", tmp_path / "long" / "r"
    for run_dir, epochs in ((short, 8), (long_, 32)):
        run_dir.mkdir(parents=True)
        long_run_log(run_dir / "events.lmdb", epochs * (2 * 500 + 8), batches=500)
    small, large = _peak_bytes(short), _peak_bytes(long_)
    assert large < 1.25 * small, (small, large)
