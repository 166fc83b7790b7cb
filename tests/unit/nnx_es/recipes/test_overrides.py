"""Overrides by dotted path (what a plan's grid and a search space set) set plain data only: never an import path,
a step function, a keyword that takes a recipe or a function, a marker or an optimizer's parameters; never a mapping
(which could carry a recipe); and the resulting spec is validated like any spec."""

from __future__ import annotations

import msgspec
import pytest

from nnx_es.errors import ConfigError, RecipeError, UnsafeRecipeError
from nnx_es.recipes import Allowed
from nnx_es.recipes.overrides import apply_overrides, check_path, label, value_at
from nnx_es.recipes.runspec import decode_spec, scaffold

BASE = scaffold(epochs=2)


def test_plain_keywords_at_every_depth_are_set_and_the_base_is_left_alone() -> None:
    new = apply_overrides(BASE, {
        "optimizers.main.kwargs.lr": 0.01, "model.kwargs.hidden": [32, 16], "model.kwargs.hidden.0": 7,
        "schedulers.0.kwargs.scheduler.kwargs.factor": 0.3, "trainer.checkpoint_lag": 1, "epochs": 3, "seed": 4,
        "data.kwargs.batch_size": 64, "callbacks.0.kwargs.patience": 2, "optimizers.main.kwargs.weight_decay": 0.1,
    })
    assert new.optimizers["main"].kwargs == {"lr": 0.01, "weight_decay": 0.1}
    assert new.model.kwargs["hidden"] == [7, 16]
    assert new.schedulers[0].kwargs["scheduler"]["kwargs"]["factor"] == 0.3
    assert (new.trainer["checkpoint_lag"], new.epochs, new.seed) == (1, 3, 4)
    assert new.data.kwargs["batch_size"] == 64 and new.callbacks[0].kwargs == {"patience": 2}
    assert BASE.optimizers["main"].kwargs == {"lr": 3e-3} and BASE.model.kwargs["hidden"] == [128]
    for path, value in (("optimizers.main.kwargs.lr", 0.01), ("model.kwargs.hidden.0", 7), ("epochs", 3)):
        assert value_at(new, path) == value
    assert value_at(msgspec.to_builtins(new), "optimizers.main.kwargs.momentum") is None
    assert label({"optimizers.main.kwargs.lr": 0.0123456, "model.kwargs.hidden.0": 7}) == "lr=0.01235 hidden.0=7"


@pytest.mark.parametrize("path", [
    "model.target",  # the import path: code
    "optimizers.main.target",
    "steps.train_step_fn",  # step functions by import path
    "schedulers.0.kwargs.scheduler",  # takes a recipe of an LR scheduler
    "schedulers.0.kwargs.scheduler.kwargs.optimizer",  # takes an optimizer (its marker)
    "optimizers.main.kwargs.params",  # the net's parameters (the @params marker)
    "model.kwargs",  # not a keyword
    "format",
])
def test_a_path_that_names_code_a_recipe_or_a_marker_is_refused(path: str) -> None:
    with pytest.raises(UnsafeRecipeError, match="refused"):
        check_path(BASE, path, Allowed())
    with pytest.raises(UnsafeRecipeError):
        apply_overrides(BASE, {path: 0.1})


@pytest.mark.parametrize("path, why", [
    ("optimizers.nope.kwargs.lr", "no optimizers entry 'nope'"),
    ("model.kwargs.hidden.5", "no index"),
    ("trainer.bogus", "trainer.<setting>"),
    ("epochs.x", "has no parts"),
    ("a..b", "dotted part"),
    ("optimizers.main.kwargs.@params", "dotted part"),
])
def test_a_path_that_names_nothing_is_named(path: str, why: str) -> None:
    with pytest.raises(RecipeError, match=why):
        apply_overrides(BASE, {path: 1})


@pytest.mark.parametrize("value", [{"@type": "recipe", "target": "os:system", "kwargs": {}}, {"@ref": "os:system"},
                                   float("nan"), float("inf"), object()])
def test_a_value_that_is_not_plain_data_is_refused(value: object) -> None:
    with pytest.raises(RecipeError, match="plain data|finite"):
        apply_overrides(BASE, {"optimizers.main.kwargs.lr": value})


def test_the_resulting_spec_goes_through_the_checks_of_any_spec() -> None:
    with pytest.raises(RecipeError, match="unexpected keyword argument 'bogus'"):
        apply_overrides(BASE, {"model.kwargs.bogus": 1})  # the target does not take it
    with pytest.raises(RecipeError, match="bad spec"):
        apply_overrides(BASE, {"epochs": "three"})  # RunSpec's own types
    with pytest.raises(ConfigError, match="epochs"):
        apply_overrides(BASE, {"epochs": -1})


def test_a_refused_recipe_of_the_base_spec_refuses_the_override_before_any_import() -> None:
    document = msgspec.to_builtins(BASE)
    document["model"] = {"@type": "recipe", "target": "os:system", "kwargs": {"command": "true"}}
    hostile = decode_spec(document)
    with pytest.raises(UnsafeRecipeError, match="os:system"):
        apply_overrides(hostile, {"model.kwargs.command": "touch /tmp/pwned"})
