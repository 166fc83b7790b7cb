"""A search SIGKILLed mid-trial and started again continues that trial under its own Optuna number (not a new
sample, not FAIL): its run resumes from its LAST and ends bit for bit as in the uninterrupted search, and the
study ends with the same trials, parameters and values (the sampler is seeded per trial). A kill between
Optuna's ``ask`` and the run's creation is taken over the same way. Two worker processes sharing one journal
run every trial once.

Killed attempts and workers are processes forked from this warm one (:func:`crashkit.run_killed`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import torch

from crashkit import kill_at_call, run_killed
from nnx_es.search import audit_study, search
from nnx_es.search.audit import load_study
from plankit import scratch, check_same_runs, kill_in_run, kinds, spec

torch.set_num_threads(1)  # fork-safe parent

SPACE = {"optimizers.main.kwargs.lr": {"float": [1e-3, 0.2], "log": True}}
TRIALS = 4


def run_search(root: Path, name: str = "s", n: int = TRIALS):
    return search(spec(), SPACE, n, runs_root=root, study_name=name, seed=3,
                  pruner=optuna.pruners.MedianPruner(n_startup_trials=2))


@pytest.fixture(scope="module")
def tmp_base() -> Iterator[Path]:
    with scratch("nnx_es_searchkill_") as d:
        yield d


@pytest.fixture(scope="module")
def reference(tmp_base: Path):
    root = tmp_base / "reference"
    return root, run_search(root)


def _trials(result) -> list[tuple[int, str, dict, float | None, str | None]]:
    return [(r.number, r.state, r.params, r.value, r.run_id) for r in result.rows]


def test_a_search_killed_mid_trial_resumes_that_trial_bitwise_under_its_number(reference, tmp_base: Path) -> None:
    ref_root, ref = reference
    root = tmp_base / "killed"
    n = len(kinds(ref_root / "s-t002"))
    assert run_killed(lambda: run_search(root), kill_in_run("s-t002", n * 2 // 3)) == "killed"
    frozen = load_study("s", runs_root=root).trials
    assert [t.state.name for t in frozen] == [r.state for r in ref.rows[:2]] + ["RUNNING"]
    result = run_search(root)
    assert _trials(result) == _trials(ref)  # the same trials, parameters and values: no new sample, no FAIL
    assert "run_resumed" in kinds(root / "s-t002") and kinds(root / "s-t002").count("run_started") == 1
    check_same_runs(ref_root, root, [r.run_id for r in ref.rows])
    assert audit_study("s", runs_root=root).ok


def test_a_search_killed_between_ask_and_sampling_takes_the_trial_over(reference, tmp_base: Path) -> None:
    ref_root, ref = reference
    root = tmp_base / "asked"
    # die as the third trial, just asked, samples its learning rate: the restart samples it (seeded per trial: as
    # the uninterrupted search did, and the trials after it too)
    assert run_killed(lambda: run_search(root), kill_at_call(optuna.trial.Trial, "suggest_float", 2)) == "killed"
    frozen = load_study("s", runs_root=root).trials
    assert frozen[2].state.name == "RUNNING" and frozen[2].params == {}
    assert not (root / "s-t002").exists()
    assert _trials(run_search(root)) == _trials(ref)
    check_same_runs(ref_root, root, [r.run_id for r in ref.rows])


def test_two_workers_share_a_study_without_running_a_trial_twice(tmp_base: Path) -> None:
    root = tmp_base / "workers"
    n = 6

    def worker(i: int) -> None:
        lines: list[str] = []
        search(spec(), SPACE, n, runs_root=root, study_name="w", echo=lines.append)
        (root / f"worker{i}.txt").write_text("\n".join(lines))

    pids = []
    for i in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                worker(i)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    assert all(os.WEXITSTATUS(os.waitpid(pid, 0)[1]) == 0 for pid in pids)
    trials = load_study("w", runs_root=root).trials
    assert [t.number for t in trials] == list(range(n))
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    run_ids = [t.user_attrs["run_id"] for t in trials]
    assert len(set(run_ids)) == n
    for run_id in run_ids:  # each run trained once: one start, never resumed or restarted
        k = kinds(root / run_id)
        assert k.count("run_started") == 1 and "run_resumed" not in k
    started = [(root / f"worker{i}.txt").read_text().count("starting") for i in range(2)]
    assert sum(started) == n and min(started) >= 1, started
    assert audit_study("w", runs_root=root).ok
