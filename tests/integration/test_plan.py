"""``nnx-es plan``: a trial per override set, each its own run; a trial whose value the constructor refuses ends
``refused`` and the plan goes on; the report ranks from the runs' logs and notes a plan log that disagrees with
them; a run directory the plan did not start is refused, never resumed or cleared."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from events.plans import TrialEnded
from nnx_es import ExperimentPlan
from nnx_es.cli.main import main
from nnx_es.errors import ConfigError
from nnx_es.plan_log import PlanLog
from plankit import kinds, spec

torch.set_num_threads(1)


def test_the_plan_command_runs_reports_and_goes_on_past_a_refused_trial(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "spec.json").write_bytes(msgspec.json.encode(spec(epochs=1)))
    (tmp_path / "plan.json").write_text(json.dumps({
        "name": "cli", "spec": "spec.json", "seeds": [0],
        "overrides": [{"optimizers.main.kwargs.lr": 0.01}, {"optimizers.main.kwargs.lr": -1.0},
                      {"optimizers.main.kwargs.lr": 0.05}]}))
    runs = tmp_path / "runs"
    argv = ["plan", str(tmp_path / "plan.json"), "--runs-dir", str(runs)]
    assert main(argv) == 1  # a trial was refused
    out = capsys.readouterr().out
    assert "trial 2/3 cli-001: refused" in out and "Invalid learning rate" in out and "trial 3/3 cli-002: completed" in out
    assert not (runs / "cli-001").exists() and (runs / "cli-002" / "events.lmdb").is_dir()
    table = out[out.index("plan cli: 3 trials"):]
    ranked = [line.split()[1] for line in table.splitlines()[2:5]]
    plan = ExperimentPlan.load(tmp_path / "plan.json")
    report = plan.report(runs)
    best = {r.trial.run_id: r.outcome.best for r in report.rows if r.outcome is not None}
    assert ranked == sorted(best, key=best.get) + ["cli-001"]  # ranked by the runs' own BEST
    assert main([*argv, "--report"]) == 0 and "plan cli: 3 trials" in capsys.readouterr().out
    assert main(argv) == 1 and "finished before" in capsys.readouterr().out
    assert kinds(runs / "cli-000").count("run_started") == 1

    with PlanLog(runs, "cli") as log:  # a plan log that disagrees with its run: the run is the record
        log.commit(TrialEnded(index=0, run_id="cli-000", status="completed", best=-1.0, best_epoch=0, epochs=1))
    report = plan.report(runs)
    assert report.rows[0].outcome.best == best["cli-000"]
    assert len(report.notes) == 1 and "the plan log says completed, best -1.0" in report.notes[0]


def test_a_run_directory_the_plan_did_not_start_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x-000").mkdir(parents=True)
    (tmp_path / "x-000" / "keep").write_text("someone's")
    with pytest.raises(ConfigError, match="never started trial 0"):
        ExperimentPlan(spec(epochs=1), name="x").fit(tmp_path)
    assert (tmp_path / "x-000" / "keep").read_text() == "someone's"
