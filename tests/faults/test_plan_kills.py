"""A six-trial experiment plan SIGKILLed at several points -- between trials, mid-trial, during a commit, after a
run finished but before the plan recorded it, several times over -- and started again ends with the same runs,
bit for bit, as the uninterrupted plan: each run's history, LAST, BEST (manifest hashes: weights, optimizer,
scheduler, RNG streams, counters) and status, and each audits clean. Trials that ended before a kill are not
rerun; the interrupted one continues from its LAST.

Each killed attempt is a process forked from this warm one (:func:`crashkit.run_killed`), on tmpfs when there
is one (a SIGKILL keeps the page cache: what survives is what survives on disk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from crashkit import run_killed
from nnx_es.plan import ExperimentPlan
from nnx_es.plan_log import read_plan
from nnx_es.testing.reference import read_log
from plankit import scratch, check_same_runs, kill_at_sync, kill_in_run, kinds, spec

torch.set_num_threads(1)  # fork-safe parent

NAME = "p"
RUN_IDS = [f"{NAME}-{i:03d}" for i in range(6)]


def make_plan() -> ExperimentPlan:
    return ExperimentPlan(spec(), name=NAME, grid={"optimizers.main.kwargs.lr": [0.003, 0.03, 0.1]}, seeds=[0, 1])


@pytest.fixture(scope="module")
def tmp_base() -> Iterator[Path]:
    with scratch("nnx_es_plan_") as d:
        yield d


@pytest.fixture(scope="module")
def reference(tmp_base: Path) -> Path:
    """The uninterrupted plan's runs root."""
    root = tmp_base / "reference"
    report = make_plan().fit(root)
    assert [r.status for r in report.rows] == ["completed"] * 6
    return root


def _events(root: Path, run_id: str) -> int:
    return len(read_log(root / run_id))


def interrupt_then_finish(root: Path, kills: list[Callable[[], None]]) -> None:
    """Start the plan once per kill in a forked child killed there (each must die), then finish it here."""
    for kill in kills:
        assert run_killed(lambda: make_plan().fit(root), kill) == "killed"
    report = make_plan().fit(root)
    assert [r.status for r in report.rows] == ["completed"] * 6 and not report.notes


def _resumed(root: Path) -> list[str]:
    """The runs that hold a run_resumed (a stateful continuation)."""
    return [r for r in RUN_IDS if "run_resumed" in kinds(root / r)]


def test_a_plan_killed_between_trials_does_not_rerun_the_ended_ones(reference: Path, tmp_base: Path) -> None:
    root = tmp_base / "between"
    # the plan log's syncs: plan_started 0, trial_started 1, trial_ended 2, trial_started 3, trial_ended 4: after
    # trial 1 ended; and, in the restart (plan_resumed 0, trial_started 1), after trial 2 started, before its run
    interrupt_then_finish(root, [kill_at_sync("plans", 4, "after"), kill_at_sync("plans", 1, "after")])
    check_same_runs(reference, root, RUN_IDS)
    assert _resumed(root) == []  # nothing was continued: nothing had begun at either kill
    assert all(kinds(root / r).count("run_started") == 1 for r in RUN_IDS)
    state = read_plan(root, NAME)
    assert state is not None and state.finished and state.resumes == 2
    assert [state.trials[i].starts for i in range(6)] == [1, 1, 2, 1, 1, 1]  # trial 2 started twice, ran once


def test_a_plan_killed_mid_trial_and_during_commits_ends_with_the_same_runs(reference: Path, tmp_base: Path) -> None:
    root = tmp_base / "mid"
    n0, n3 = _events(reference, RUN_IDS[0]), _events(reference, RUN_IDS[3])
    interrupt_then_finish(root, [
        kill_in_run(RUN_IDS[0], n0 * 2 // 3),  # in trial 0's second epoch: it continues from its first epoch's LAST
        kill_at_sync(RUN_IDS[3], 2, "before"),  # trial 3's first epoch's LAST commit never returns
        kill_in_run(RUN_IDS[3], 5),  # trial 3 again, before its resume wrote much
        # this attempt's plan log: plan_resumed 0, trial 3 started 1 / ended 2, trial 4 3 / 4, trial 5 5 / 6: trial
        # 5's run finished (finalized, durable), its trial_ended never written
        kill_at_sync("plans", 6, "before"),
    ])
    check_same_runs(reference, root, RUN_IDS)
    resumed = _resumed(root)
    assert RUN_IDS[0] in resumed and set(resumed) <= {RUN_IDS[0], RUN_IDS[3]}
    assert all(kinds(root / r).count("run_started") == 1 for r in RUN_IDS)
    assert kinds(root / RUN_IDS[5]).count("run_finalized") == 1  # a finished run is taken as it is, not resumed
    assert n3 > 5


def test_a_plan_started_again_after_it_finished_runs_nothing(reference: Path) -> None:
    before = {r: _events(reference, r) for r in RUN_IDS}
    report = make_plan().fit(reference)
    assert {r: _events(reference, r) for r in RUN_IDS} == before
    best = report.best
    assert best is not None and best.outcome is not None
    assert all(r.outcome.best >= best.outcome.best for r in report.rows if r.outcome and r.outcome.best is not None)
