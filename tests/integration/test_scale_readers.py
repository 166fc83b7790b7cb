"""bench/scale.py's readers on a modest long log: each snapshot-based answer equals a fold from 0.

The benchmark times them on 10 M events; here the same log shape (``long_run_log`` with the
recorder's snapshots, a snapshot every 3000 events) is small enough to fold from 0 for every
comparison. No timings are asserted.
"""

from __future__ import annotations

import pytest

from bench.scale import answers_equal_full_fold, write_run
from events.log import LmdbLog
from nnx_es.audit import audit_run


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    run_dir, n, _ = write_run(tmp_path_factory.mktemp("scale"), 30_000, snapshot_every=3000)
    return run_dir, n


def test_snapshot_based_readers_equal_a_full_fold_on_a_long_log(long_run):
    run_dir, n = long_run
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        snaps = [s for s, _ in log.read_snapshots(newest_first=False)]
    assert len(snaps) >= 8
    # both sides of several snapshots, the first events and the last one
    seqs = sorted({0, 5, snaps[0] - 1, snaps[0], snaps[0] + 1, snaps[3] - 1, snaps[3], n // 2, snaps[-1], n - 2, n - 1})
    answers = answers_equal_full_fold(run_dir, seqs)
    assert answers == {k: True for k in answers} and len(answers) == len(seqs) + 3


def test_replay_of_the_long_log_meets_every_snapshot(long_run):
    run_dir, _ = long_run
    report = audit_run(run_dir)
    # the bench's log stores no blobs (invariant 4 names each manifest) and its plateau steps carry no
    # plateau state (invariant 7); the snapshots, compared with the fold from 0, are not among them
    assert {v.invariant for v in report.violations} == {4, 7}
    assert not [n for n in report.notes if "snapshot" in n]
