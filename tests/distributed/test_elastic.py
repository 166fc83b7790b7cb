"""Elastic restart: under ``torchrun --max-restarts=1`` the writer rank SIGKILLed mid-epoch makes the agent
restart the group, and ``fit(resume="auto")`` continues the run from LAST to the same parameters
(bitwise) as an uninterrupted 2-rank run (issue 13, "Elastic restart"), its dropout included: each
rank's own RNG stream is restored from the checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launch import REPO, results, torchrun
from nnx_es.audit import audit_run
from trainkit import of_kind

SCRIPT = REPO / "tests" / "distributed" / "elastic_script.py"
TIMEOUT_S = 150.0


def test_a_rank_killed_mid_epoch_restarts_and_resumes_to_the_uninterrupted_parameters(tmp_path):
    # one launch: an uninterrupted reference run, then the run where the writer (rank 0) kills itself
    # after microbatch 2 of epoch 1 (epoch 0's LAST is committed, epoch 1 is not; its log may hold an
    # uncommitted tail); torchrun stops the other rank and restarts both
    try:
        proc = torchrun(SCRIPT, str(tmp_path), "0:1:2", max_restarts=1, timeout_s=TIMEOUT_S,
                        warm=False)  # the agent restarts a new interpreter, as in production
    except subprocess.TimeoutExpired as exc:  # a hang is a failure, never a stuck suite
        pytest.fail(f"the launch did not end within {TIMEOUT_S} s:\n{(exc.output or '')[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-4000:]

    assert (tmp_path / "elastic.killed").exists(), "the planted kill never fired"
    reference, elastic = results(tmp_path, "reference"), results(tmp_path, "elastic")
    assert [r.get("missing") for r in reference + elastic] == [None] * 4
    assert [r["restarts"] for r in reference] == [0, 0]  # the reference ran before the kill
    assert [r["restarts"] for r in elastic] == [1, 1]  # the run ended in the restarted group
    for ref, got in zip(reference, elastic):
        assert got["status"] == ref["status"] == "completed"
        assert (got["epoch"], got["step"]) == (ref["epoch"], ref["step"])
        assert got["params"] == ref["params"]  # float32 values as float64: equal lists = bitwise equal
        assert got["rng"] == ref["rng"]  # each rank's own stream (its dropout masks) restored, not re-seeded
    assert elastic[0]["params"] == elastic[1]["params"]
    assert reference[0]["rng"] != reference[1]["rng"]  # every rank drew from a stream of its own
    # the restarted group resumed the run from epoch 0's LAST (it did not start over)
    run_dir = tmp_path / "runs" / "elastic"
    (resumed,) = of_kind(run_dir, "run_resumed")
    assert resumed.epoch == 0
    (started,) = of_kind(run_dir, "run_started")
    assert (started.world_size, started.writer_rank) == (2, 0)  # the run declares the group it trains in
    assert not of_kind(tmp_path / "runs" / "reference", "run_resumed")
    for run in (run_dir, tmp_path / "runs" / "reference"):  # tools/replay accepts the killed-and-resumed log
        report = audit_run(run)
        assert report.ok, [str(v) for v in report.violations]


def _gradient_bytes() -> int:
    import elastic_script

    return sum(p.numel() * p.element_size() for p in elastic_script.net().parameters())
    _assert_receipts(tmp_path / "runs" / "reference")


def _assert_receipts(run_dir: Path) -> None:
    """The step receipts of a 2-rank run (spec 003): every window of 4 rows a rank, 8 over both."""
    import elastic_script

    grad_bytes = sum(p.numel() * p.element_size() for p in elastic_script.net().parameters())
    receipts = of_kind(run_dir, "update_committed")
    assert len(receipts) == elastic_script.EPOCHS * (elastic_script.ROWS // 2 // elastic_script.BATCH)
    for r in receipts:
        assert (r.data_parallel_size, r.accumulation_steps, r.microbatches, r.skipped) == (2, 1, 1, False)
        assert (r.local_examples, r.global_examples) == (float(elastic_script.BATCH), 2.0 * elastic_script.BATCH)
        assert r.collective_bytes >= grad_bytes  # at least the gradients' all-reduce, every window
