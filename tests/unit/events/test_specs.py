"""events.specs.spec_differences: what a resume names when a spec is not the run's."""

from __future__ import annotations

from events.specs import spec_differences


def test_spec_differences_name_each_path_with_the_runs_value_and_the_given_one() -> None:
    run = {"optimizers": {"main": {"kwargs": {"lr": 0.003}}}, "metrics": ["accuracy"], "epochs": 2, "seed": 0}
    given = {"optimizers": {"main": {"kwargs": {"lr": 0.1}}}, "metrics": ["accuracy", "f1"], "epochs": 9,
             "seed": 0}
    assert spec_differences(run, given) == ["metrics: ['accuracy'] in the run, ['accuracy', 'f1'] given",
                                            "optimizers.main.kwargs.lr: 0.003 in the run, 0.1 given"]


def test_spec_differences_ignore_epochs_and_an_absent_key_whose_other_side_is_empty() -> None:
    assert spec_differences({"epochs": 2, "transforms": []}, {"epochs": 30}) == []
    assert spec_differences({"k": {"a": 1}}, {"k": {}}) == ["k.a: 1 in the run, absent given"]


def test_spec_differences_tell_true_from_1_and_not_1_from_1_0() -> None:
    assert spec_differences({"x": [True]}, {"x": [1]}) == ["x.0: True in the run, 1 given"]
    assert spec_differences({"x": 1}, {"x": 1.0}) == []
