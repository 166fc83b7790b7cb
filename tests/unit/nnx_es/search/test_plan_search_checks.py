"""What a plan and a search refuse before anything is written or trained: a process group of several ranks (spec
000, "Out of scope"), a bad name, grid, seed or space, a path that names code, a spec without a monitor, a study of
the same name searching something else."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from nnx_es import ExperimentPlan
from nnx_es.errors import ConfigError, InvalidRunIdError, RecipeError, UnsafeRecipeError
from nnx_es.recipes.runspec import scaffold
from nnx_es.search import parse_space, search

BASE = scaffold(epochs=1)
LR = "optimizers.main.kwargs.lr"


@pytest.mark.parametrize("entry", ["plan", "search"])
def test_a_process_group_of_several_ranks_is_refused(entry: str, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one of 2 ranks"):
        if entry == "plan":
            ExperimentPlan(BASE, name="p", grid={LR: [0.1]}).fit(tmp_path)
        else:
            search(BASE, {LR: {"float": [1e-3, 1e-1]}}, 1, runs_root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_plan_lists_its_trials_overrides_times_seeds_and_refuses_bad_input(tmp_path: Path) -> None:
    plan = ExperimentPlan(BASE, name="g", grid={LR: [0.1, 0.01], "model.kwargs.hidden.0": [8]}, seeds=[3, 4])
    assert [(t.run_id, t.overrides[LR], t.seed, t.spec.seed, t.spec.optimizers["main"].kwargs["lr"])
            for t in plan.trials] == [("g-000", 0.1, 3, 3, 0.1), ("g-001", 0.1, 4, 4, 0.1),
                                      ("g-002", 0.01, 3, 3, 0.01), ("g-003", 0.01, 4, 4, 0.01)]
    assert plan.declaration()["trials"][3] == {"overrides": {LR: 0.01, "model.kwargs.hidden.0": 8}, "seed": 4}
    with pytest.raises(InvalidRunIdError):
        ExperimentPlan(BASE, name="../x")
    with pytest.raises(ConfigError, match="not both"):
        ExperimentPlan(BASE, name="x", grid={LR: [0.1]}, overrides=[{LR: 0.1}])
    with pytest.raises(ConfigError, match="non-empty list"):
        ExperimentPlan(BASE, name="x", grid={LR: []})
    with pytest.raises(ConfigError, match="seeds"):
        ExperimentPlan(BASE, name="x", seeds=[-1])
    with pytest.raises(ConfigError, match="both in its overrides and by seeds"):
        ExperimentPlan(BASE, name="x", overrides=[{"seed": 1}], seeds=[2])
    with pytest.raises(UnsafeRecipeError):
        ExperimentPlan(BASE, name="x", grid={"model.target": ["os:system"]})
    with pytest.raises(RecipeError, match="plain data"):
        ExperimentPlan(BASE, name="x", overrides=[{LR: {"@ref": "os:system"}}])
    assert list(tmp_path.iterdir()) == []


def test_a_plan_file_names_its_spec_beside_it(tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_bytes(msgspec.json.encode(BASE))
    (tmp_path / "plan.json").write_text('{"name": "f", "spec": "spec.json", "overrides": [{"epochs": 2}]}')
    plan = ExperimentPlan.load(tmp_path / "plan.json")
    assert [t.spec.epochs for t in plan.trials] == [2]
    (tmp_path / "bad.json").write_text('{"name": "f", "spec": "spec.json", "grids": {}}')
    with pytest.raises(RecipeError, match="grids"):
        ExperimentPlan.load(tmp_path / "bad.json")


@pytest.mark.parametrize("space, why", [
    ({}, "maps 1 to"),
    ({LR: {"float": [1e-3]}}, r"\[low, high\]"),
    ({LR: {"float": [0.1, 0.01]}}, "low <= high"),
    ({LR: {"float": [0.0, 0.1], "log": True}}, "log scale needs low > 0"),
    ({LR: {"int": [1.5, 3]}}, "ints"),
    ({LR: {"float": [1e-3, 1e-1], "int": [1, 2]}}, "exactly one"),
    ({LR: {"categorical": [{"@ref": "os:system"}]}}, "each null, a bool"),
    ({LR: {"categorical": [1], "log": True}}, "no log or step"),
    ({LR: {"float": [1e-3, 1e-1], "step": -1}}, "step takes"),
])
def test_a_malformed_space_is_named(space: dict, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_space(space)


def test_a_search_refuses_before_it_opens_a_study(tmp_path: Path) -> None:
    space = {LR: {"float": [1e-3, 1e-1], "log": True}}
    with pytest.raises(ConfigError, match="has no"):
        search(scaffold(epochs=1, val_fraction=0.0), space, 1, runs_root=tmp_path)  # no monitor
    with pytest.raises(UnsafeRecipeError):
        search(BASE, {"schedulers.0.kwargs.scheduler": {"categorical": ["x"]}}, 1, runs_root=tmp_path)
    with pytest.raises(RecipeError):  # a value of the space the spec refuses, found before any trial
        search(BASE, {"epochs": {"categorical": ["three"]}}, 1, runs_root=tmp_path)
    with pytest.raises(ConfigError, match="n_trials"):
        search(BASE, space, 0, runs_root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_study_name_searching_another_space_is_refused(tmp_path: Path) -> None:
    import optuna

    from nnx_es.search.study import default_storage, study_dir

    storage = default_storage(study_dir(tmp_path, "s"))  # a study of that name, recording another declaration
    study = optuna.create_study(storage=storage, study_name="s")
    study.set_user_attr("nnx_es", {"format": 1, "space": {"x": 1}})
    with pytest.raises(ConfigError, match="searches another"):
        search(BASE, {LR: {"float": [1e-3, 1e-1], "log": True}}, 1, runs_root=tmp_path, study_name="s")
    assert not any(p.name.startswith("s-t") for p in tmp_path.iterdir())


def test_hostile_inputs_beside_a_search_are_refused_or_not_followed(tmp_path: Path) -> None:
    import optuna

    from nnx_es.errors import InvalidRunIdError, UnsafePathError
    from nnx_es.search import audit_study
    from nnx_es.search.report import study_result
    from nnx_es.search.study import default_storage, study_dir

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RecipeError, match="nested too deep"):
        parse_space(deep)
    with pytest.raises(InvalidRunIdError, match="study name"):
        audit_study("../x", runs_root=tmp_path)
    (study_dir(tmp_path, "j") / "journal.log").symlink_to(tmp_path / "victim")
    with pytest.raises(UnsafePathError):
        search(BASE, {LR: {"float": [1e-3, 1e-1]}}, 1, runs_root=tmp_path, study_name="j")
    assert not (tmp_path / "victim").exists()
    # a study whose trial names a run outside the runs root: never read through
    study = optuna.create_study(storage=default_storage(study_dir(tmp_path, "h")), study_name="h")
    trial = study.ask()
    trial.set_user_attr("run_id", "../../etc")
    study.tell(trial, 1.0)
    assert study_result(study, tmp_path).rows[0].run_id is None
    assert any("no run id" in f for f in audit_study("h", runs_root=tmp_path).findings)
