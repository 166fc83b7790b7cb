"""A TPE search with a median pruner on digits: pruning fires, a pruned trial's run ends ``stopped`` / ``pruned`` and
audits clean, the study's values are the runs' BEST monitor values, the study audit agrees -- and catches a value
edited in the study's journal to disagree with its run. A search on an RDB URL (a local SQLite file) too, and the
``nnx-es search`` command (progress, table, plots, ``--audit`` exit statuses).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import optuna
import pytest
import torch

from nnx_es.audit import audit_run
from nnx_es.cli.main import main
from nnx_es.search import audit_study, search
from nnx_es.trial_runs import run_outcome
from plankit import scratch, spec

torch.set_num_threads(1)

SPACE = {"optimizers.main.kwargs.lr": {"float": [1e-4, 0.3], "log": True}}


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    with scratch("nnx_es_search_") as d:
        yield d


@pytest.fixture(scope="module")
def pruned_search(root: Path):
    lines: list[str] = []
    result = search(spec(epochs=3), SPACE, 7, runs_root=root / "runs", study_name="tpe",
                    pruner=optuna.pruners.MedianPruner(n_startup_trials=2), echo=lines.append)
    return result, lines


def test_pruning_fires_and_pruned_runs_stop_with_reason_pruned_and_audit_clean(pruned_search, root: Path) -> None:
    result, lines = pruned_search
    states = [r.state for r in result.rows]
    assert len(states) == 7 and "PRUNED" in states and states.count("COMPLETE") >= 2, states
    for r in result.rows:
        o = run_outcome(root / "runs" / r.run_id)
        assert o is not None and r.outcome == o
        if r.state == "PRUNED":
            assert (o.status, o.stop_reason) == ("stopped", "pruned")
            assert o.epochs < 3 and r.value == o.values[-1]  # Optuna keeps the last report: the run's last epoch
        else:
            assert r.state == "COMPLETE" and o.status == "completed" and r.value == o.best
        report = audit_run(root / "runs" / r.run_id)
        assert report.ok, [v.line() for v in report.violations]
        # every committed epoch's monitor value was reported to the trial
        frozen = result.study.trials[r.number]
        assert [frozen.intermediate_values[e] for e in range(o.epochs)] == list(o.values)
    assert sum("starting" in line for line in lines) == 7 and any("best so far" in line for line in lines)
    best = result.best
    assert best is not None and best.value == min(r.value for r in result.rows if r.state == "COMPLETE")


def test_the_study_audit_agrees_and_catches_a_value_edited_in_the_journal(pruned_search, root: Path) -> None:
    result, _ = pruned_search
    assert audit_study("tpe", runs_root=root / "runs").ok
    copy = root / "edited"
    shutil.copytree(root / "runs", copy, symlinks=True)
    journal = copy / "studies" / "tpe" / "journal.log"
    complete = next(r for r in result.rows if r.state == "COMPLETE")
    lines = journal.read_text().splitlines()
    for i, line in enumerate(lines):
        op = json.loads(line)
        if op.get("op_code") == 6 and op.get("values") and op.get("trial_id") == complete.number:
            op["values"] = [op["values"][0] * 0.5]  # the study now claims a better value than its run reached
            lines[i] = json.dumps(op)
    journal.write_text("\n".join(lines) + "\n")
    audit = audit_study("tpe", runs_root=copy)
    assert not audit.ok
    assert any(f"trial {complete.number} (COMPLETE): value" in f and "not its run's BEST" in f for f in audit.findings)
    assert main(["search", "--audit", "tpe", "--runs-dir", str(copy), "--no-replay"]) == 1
    assert main(["search", "--audit", "tpe", "--runs-dir", str(root / "runs")]) == 0


def test_a_search_on_an_sqlite_url_keeps_its_study_there(root: Path) -> None:
    url = f"sqlite:///{root / 'study.db'}"
    result = search(spec(), SPACE, 2, runs_root=root / "sql", study_name="sql", storage=url)
    assert [r.state for r in result.rows] == ["COMPLETE", "COMPLETE"]
    assert [r.value for r in result.rows] == [r.outcome.best for r in result.rows]
    assert not (root / "sql" / "studies" / "sql" / "journal.log").exists()
    assert optuna.load_study(study_name="sql", storage=url).trials[1].value == result.rows[1].value
    assert audit_study("sql", storage=url, runs_root=root / "sql").ok


def test_the_search_command_prints_progress_a_table_and_plots(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = root / "cli"
    work.mkdir()
    (work / "spec.json").write_bytes(msgspec.json.encode(spec()))
    (work / "space.json").write_text(json.dumps({"optimizers.main.kwargs.lr": {"float": [1e-3, 0.1], "log": True},
                                                 "model.kwargs.hidden.0": {"categorical": [16, 32]}}))
    argv = ["search", str(work / "spec.json"), "--space", str(work / "space.json"), "--trials", "2", "--study", "c",
            "--runs-dir", str(work / "runs"), "--pruner", "none"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trial 1/2 (#0, run c-t000)" in out and "trial 2/2" in out and "study c (minimize): 2 trials" in out
    assert "hidden.0=" in out
    assert (work / "runs" / "studies" / "c" / "history.png").stat().st_size > 1000
    assert (work / "runs" / "studies" / "c" / "importances.png").stat().st_size > 1000
    assert main(argv) == 0  # again: the study holds its 2 trials, nothing more runs
    assert "starting" not in capsys.readouterr().out
