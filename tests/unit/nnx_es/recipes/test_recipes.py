"""Recipes: every built-in component round-trips through JSON; refusals name what was wrong; the import guard."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

from nnx_es import EMA, EarlyStopping, GradientAccumulation, GradientClipping, LambdaCallback, MixedPrecision, Monitor
from nnx_es import Callback, Objective, Scheduler, Trainer
from nnx_es.errors import RecipeError, UnsafeRecipeError
from nnx_es.recipes import Allowed, BuildContext, Recipe, from_spec, to_spec
from nnx_es.recipes.models import MLP

OPTIMIZERS = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
              torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
              torch.optim.Rprop]


def module_level_hook(ctx):  # an importable function: a recipe records its path
    return None


def halve(epoch: int) -> float:
    return 0.5**epoch


TESTS = Allowed([__name__.split(".")[0]])  # this test module: trusted here


def json_round_trip(recipe: Recipe) -> Recipe:
    return msgspec.json.decode(msgspec.json.encode(recipe), type=Recipe)


@pytest.fixture
def net() -> nn.Module:
    return MLP(4, 3, hidden=[5])


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_torch_optimizers_round_trip_with_parameter_groups(cls, net) -> None:
    first, rest = list(net.parameters())[:1], list(net.parameters())[1:]
    opt = cls([{"params": first}, {"params": rest, "lr": 0.05}], lr=0.01)
    recipe = to_spec(opt, net=net)
    rebuilt = from_spec(json_round_trip(recipe), context=BuildContext(net=net))
    assert type(rebuilt) is cls
    assert [g["lr"] for g in rebuilt.param_groups] == [0.01, 0.05]
    assert [len(g["params"]) for g in rebuilt.param_groups] == [1, len(rest)]
    assert to_spec(cls([{"params": first}, {"params": rest, "lr": 0.05}], lr=0.01), net=net) == recipe


SCHEDULERS = [
    lambda o: L.StepLR(o, 3, gamma=0.5), lambda o: L.MultiStepLR(o, [2, 5]), lambda o: L.ExponentialLR(o, 0.9),
    lambda o: L.CosineAnnealingLR(o, 10, eta_min=1e-4), lambda o: L.ReduceLROnPlateau(o, mode="max", patience=2),
    lambda o: L.LinearLR(o, start_factor=0.5), lambda o: L.ConstantLR(o, factor=0.5), lambda o: L.PolynomialLR(o, 7),
    lambda o: L.CosineAnnealingWarmRestarts(o, 5), lambda o: L.LambdaLR(o, halve),
]


@pytest.mark.parametrize("make", SCHEDULERS)
def test_torch_schedulers_round_trip_inside_the_scheduler_wrapper(make, net) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    wrapped = Scheduler(make(opt), clock="epoch", name="s")
    recipe = to_spec(wrapped, net=net, optimizers={"main": opt})
    rebuilt = from_spec(json_round_trip(recipe), allowed=TESTS, context=BuildContext(net=net, optimizers={"main": opt}))
    assert isinstance(rebuilt, Scheduler) and type(rebuilt.scheduler) is type(wrapped.scheduler)
    assert rebuilt.scheduler.optimizer is opt and rebuilt.name == "s" and rebuilt.clock == "epoch"
    fresh = Scheduler(make(torch.optim.SGD(net.parameters(), lr=0.1)), clock="epoch", name="s")
    assert to_spec(fresh, net=net, optimizers={"main": fresh.optimizer}) == recipe  # read back from a live object


def test_schedulers_torch_cannot_describe_refuse_naming_the_argument_unless_built_from_a_recipe(net) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(RecipeError, match="max_lr"):
        to_spec(L.OneCycleLR(opt, max_lr=0.1, total_steps=10), optimizers={"main": opt})
    recipe = Recipe(target="torch.optim.lr_scheduler:OneCycleLR",
                    kwargs={"optimizer": {"@optimizer": "main"}, "max_lr": 0.1, "total_steps": 10})
    built = from_spec(recipe, context=BuildContext(net=net, optimizers={"main": opt}))
    assert to_spec(built, optimizers={"main": opt}) == recipe


BUILTINS = [
    lambda: EarlyStopping(3, min_epochs=2, monitor="val_loss"), lambda: Callback(), lambda: Monitor("val_acc", "max", 0.1),
    lambda: EMA(0.9, name="fast"), lambda: GradientClipping(1.5), lambda: MixedPrecision("bf16", init_scale=8.0),
    lambda: GradientAccumulation(4), lambda: LambdaCallback(name="lc", on_epoch_end=module_level_hook),
    lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]), label_smoothing=0.1),
    lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0])), lambda: nn.MSELoss(), lambda: nn.HuberLoss(delta=2.0),
    lambda: nn.NLLLoss(ignore_index=3), lambda: nn.SmoothL1Loss(beta=0.5), lambda: nn.L1Loss(),
    lambda: Objective({"ce": nn.CrossEntropyLoss(), "aux": (nn.MSELoss(), 0.5)}),
    lambda: MLP(4, 3, hidden=[8, 8], activation="tanh", dropout=0.1),
]


@pytest.mark.parametrize("make", BUILTINS)
def test_builtin_components_round_trip(make) -> None:
    obj = make()
    recipe = to_spec(obj)
    rebuilt = from_spec(json_round_trip(recipe), allowed=TESTS)
    assert type(rebuilt) is type(obj)
    assert to_spec(rebuilt) == recipe
    assert to_spec(make()) == recipe  # a fresh object, not one the registry knows


def test_a_misspelt_keyword_is_named_when_the_recipe_is_built() -> None:
    with pytest.raises(RecipeError, match="patiense"):
        from_spec(Recipe(target="nnx_es.callbacks:EarlyStopping", kwargs={"patiense": 3}))


def test_a_model_whose_arguments_cannot_be_recovered_is_refused_before_training_naming_it(tmp_path) -> None:
    class Hidden(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.lin = nn.Linear(width, 2)  # `width` is kept under no attribute of its name

    net = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(RecipeError, match="args"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), recipe_required=True,
                runs_root=tmp_path)
    hidden = Hidden(4)
    with pytest.raises(RecipeError, match="local|width"):
        Trainer(hidden, torch.optim.SGD(hidden.parameters(), lr=0.1), nn.CrossEntropyLoss(), recipe_required=True,
                runs_root=tmp_path)
    Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path)  # as today


def test_a_lambda_step_function_is_refused_where_a_recipe_is_required(tmp_path) -> None:
    net = MLP(4, 2)
    with pytest.raises(RecipeError, match="train_step_fn.*lambda"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), recipe_required=True,
                train_step_fn=lambda n, b: None, runs_root=tmp_path)


# --- the import guard -------------------------------------------------------------------------


def test_a_path_that_does_not_import_is_named() -> None:
    with pytest.raises(RecipeError, match="nnx_es.nothing_here"):
        from_spec(Recipe(target="nnx_es.nothing_here:Thing"))


def test_a_module_outside_the_allowed_prefixes_is_refused() -> None:
    with pytest.raises(UnsafeRecipeError, match="outside the allowed"):
        from_spec(Recipe(target="os:system", kwargs={"command": "true"}))
    with pytest.raises(UnsafeRecipeError):
        Allowed().check_text("torchvision.models:resnet18")  # a prefix is matched on whole names


def test_an_alias_that_resolves_outside_the_prefixes_is_refused() -> None:
    allowed = Allowed(["logging"])
    with pytest.raises(UnsafeRecipeError, match="resolves to"):
        allowed.resolve("logging.os.system")
    with pytest.raises(UnsafeRecipeError, match="resolves to"):
        Allowed().resolve("torch:os.system")


def test_private_names_and_denied_modules_are_refused() -> None:
    with pytest.raises(UnsafeRecipeError, match="private"):
        Allowed().check_text("torch._C:_nn")
    with pytest.raises(UnsafeRecipeError, match="denied"):
        Allowed().check_text("torch.hub:load")
    with pytest.raises(UnsafeRecipeError, match="denied|resolves"):
        Allowed().resolve("torch:load")


def test_a_recipe_cannot_widen_the_allowed_prefixes() -> None:
    with pytest.raises(UnsafeRecipeError):
        from_spec({"target": "subprocess:Popen", "kwargs": {"args": ["true"], "allow": ["subprocess"]}})


def test_lambdas_and_local_functions_have_no_recipe() -> None:
    with pytest.raises(RecipeError, match="lambda"):
        to_spec(LambdaCallback(on_epoch_end=lambda ctx: None))


def test_a_stored_spec_pointing_at_a_process_spawner_imports_nothing(tmp_path) -> None:
    """A run whose stored spec names pty.spawn (a module nothing here imports) is refused and pty stays unimported."""
    code = f"""
import sys, msgspec
from nnx_es.recipes.runspec import decode_spec, scaffold, build_run
from nnx_es.errors import UnsafeRecipeError
doc = msgspec.to_builtins(scaffold(epochs=1))
doc["callbacks"] = [{{"@type": "recipe", "target": "pty:spawn", "kwargs": {{"argv": ["sh"]}}}}]
assert "pty" not in sys.modules
try:
    build_run(decode_spec(doc), runs_root={str(tmp_path)!r}, run_id="x")
except UnsafeRecipeError as exc:
    assert "pty:spawn" in str(exc), exc
else:
    raise SystemExit("not refused")
assert "pty" not in sys.modules, "pty was imported"
print("refused")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr
    assert not (tmp_path / "x").exists()
