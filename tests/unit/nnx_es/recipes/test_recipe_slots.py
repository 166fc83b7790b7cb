"""Recipes are instantiated by type: each slot of a spec takes a class of its base or a registered factory; nested
keywords are typed by their parameter; the user's own package (--allow) is type-checked too."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from nnx_es.errors import RecipeError, UnsafeRecipeError
from nnx_es.recipes import Allowed, BuildContext, Recipe, from_spec
from nnx_es.recipes.core import MAX_TENSOR_VALUES, validate_recipe
from nnx_es.recipes.runspec import decode_spec, scaffold, validate_spec
from nnx_es.recipes.slots import SLOTS, register

USER_PACKAGE = '''
import os
from torch import nn
from nnx_es.callbacks import Callback


class Net(nn.Module):
    def __init__(self, width: int = 3, backbone: nn.Module | None = None, extra=None) -> None:
        super().__init__()
        self.width, self.backbone, self.extra = width, backbone, extra
        self.lin = nn.Linear(width, 2)


class NotAModule:
    def __init__(self, width: int = 3) -> None:
        self.width = width


class Logger(Callback):
    pass


def make_net(width: int = 3) -> nn.Module:
    return Net(width)


def make_text() -> str:
    return "not a module"


def loaders(n: int = 4):
    return [n], None


def hook(ctx) -> None:
    return None
'''


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(USER_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield Allowed(["userpkg"])
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        del sys.modules[name]


def recipe(target: str, **kwargs) -> Recipe:
    return Recipe(target=target, kwargs=kwargs)


@pytest.mark.parametrize(("slot", "target"), [
    ("model", "torch.optim.adam:Adam"), ("optimizer", "torch.nn.modules.linear:Linear"),
    ("callback", "nnx_es.monitor:Monitor"), ("monitor", "nnx_es.callbacks:EarlyStopping"),
    ("hook", "nnx_es.callbacks:EarlyStopping"), ("loss", "nnx_es.schedulers:Scheduler"),
    ("data", "nnx_es.recipes.models:MLP"), ("scheduler", "torch.optim.lr_scheduler:StepLR"),
])
def test_a_class_of_another_slot_is_refused_naming_the_slot(slot, target) -> None:
    with pytest.raises(UnsafeRecipeError, match=f"recipe path '{target}'.*{slot}"):
        validate_recipe(recipe(target), slot=slot)


@pytest.mark.parametrize("target", [
    "nnx_es.recipes.core:from_spec", "nnx_es.recipes.runspec:build_run", "nnx_es.recipes.imports:Allowed",
    "nnx_es.storage:BlobStore", "torch.nn.functional:cross_entropy", "torch:zeros", "nnx_es.objective:row_losses",
])
def test_a_callable_that_is_no_constructor_of_the_slot_is_refused(target) -> None:
    with pytest.raises(UnsafeRecipeError):
        from_spec(recipe(target))


def test_the_guard_cannot_be_re_entered_with_a_wider_allow_list(tmp_path) -> None:
    marker = tmp_path / "ran"
    inner = {"target": "torch.utils.collect_env:run", "kwargs": {"command": f"touch {marker}"}}
    widened = {"@type": "recipe", "target": "nnx_es.recipes.imports:Allowed", "kwargs": {"extra": ["os"]}}
    with pytest.raises(UnsafeRecipeError, match="from_spec"):
        from_spec(recipe("nnx_es.recipes.core:from_spec", recipe=inner, allowed=widened), slot="model")
    with pytest.raises(UnsafeRecipeError, match="Allowed"):  # nested in a keyword that takes a class
        from_spec(recipe("nnx_es.schedulers:Scheduler", scheduler=widened))
    assert not marker.exists()


def test_the_users_package_is_type_checked_like_torch(userpkg) -> None:
    assert type(from_spec(recipe("userpkg.models:Net", width=4), allowed=userpkg, slot="model")).__name__ == "Net"
    assert type(from_spec(recipe("userpkg.models:make_net"), allowed=userpkg, slot="model")).__name__ == "Net"
    with pytest.raises(UnsafeRecipeError, match="NotAModule.*model"):
        from_spec(recipe("userpkg.models:NotAModule"), allowed=userpkg, slot="model")
    with pytest.raises(RecipeError, match="make_text: the factory returned str"):
        from_spec(recipe("userpkg.models:make_text"), allowed=userpkg, slot="model")
    with pytest.raises(UnsafeRecipeError, match="resolves to 'posix.system'"):  # an alias out of the package
        from_spec(recipe("userpkg.models:os.system", command="true"), allowed=userpkg, slot="model")
    assert from_spec(recipe("userpkg.models:loaders", n=2), allowed=userpkg, slot="data") == ([2], None)
    with pytest.raises(UnsafeRecipeError, match="Net"):
        from_spec(recipe("userpkg.models:Net"), allowed=userpkg, slot="callback")


def test_a_nested_recipe_is_typed_by_its_parameters_annotation(userpkg) -> None:
    linear = {"@type": "recipe", "target": "torch.nn.modules.linear:Linear", "kwargs": {"in_features": 2,
                                                                                        "out_features": 2}}
    net = from_spec(recipe("userpkg.models:Net", backbone=linear), allowed=userpkg, slot="model")
    assert isinstance(net.backbone, torch.nn.Linear)
    stopping = {"@type": "recipe", "target": "nnx_es.callbacks:EarlyStopping", "kwargs": {}}
    with pytest.raises(UnsafeRecipeError, match="EarlyStopping.*torch.nn.modules.module:Module"):
        from_spec(recipe("userpkg.models:Net", backbone=stopping), allowed=userpkg, slot="model")
    with pytest.raises(UnsafeRecipeError, match=r"Net\(extra=...\): a recipe is not accepted here.*plain data"):
        from_spec(recipe("userpkg.models:Net", extra=linear), allowed=userpkg, slot="model")
    assert from_spec(recipe("userpkg.models:Net", extra={"a": [1, "b", None]}), allowed=userpkg).extra == {
        "a": [1, "b", None]}


def test_an_at_ref_stands_only_where_a_function_is_expected(userpkg) -> None:
    hook = {"@ref": "userpkg.models:hook"}
    built = from_spec(recipe("nnx_es.callbacks:LambdaCallback", on_epoch_end=hook), allowed=userpkg, slot="callback")
    assert built.on_epoch_end.__name__ == "hook"
    for ref in ("torch:save", "torch.utils.collect_env:run", "nnx_es.recipes.core:from_spec"):
        with pytest.raises(UnsafeRecipeError, match=ref):
            from_spec(recipe("nnx_es.callbacks:LambdaCallback", on_epoch_end={"@ref": ref}), allowed=userpkg)
    with pytest.raises(UnsafeRecipeError, match="@ref 'userpkg.models:hook' is not accepted here"):
        from_spec(recipe("userpkg.models:Net", extra=hook), allowed=userpkg)
    with pytest.raises(UnsafeRecipeError, match="class"):  # a class where a function is expected
        from_spec(recipe("nnx_es.callbacks:LambdaCallback", on_epoch_end={"@ref": "userpkg.models:Logger"}),
                  allowed=userpkg)


def test_trusted_code_registers_a_factory_for_a_slot(userpkg, monkeypatch) -> None:
    monkeypatch.setitem(SLOTS, "data", SLOTS["data"])
    with pytest.raises(UnsafeRecipeError):
        from_spec(recipe("userpkg.models:loaders"), slot="data")  # not allowed, not registered
    register("data", "userpkg.models:loaders")
    assert from_spec(recipe("userpkg.models:loaders"), slot="data") == ([4], None)
    with pytest.raises(UnsafeRecipeError):
        from_spec(recipe("userpkg.models:loaders"), slot="model")  # registered for data only
    with pytest.raises(RecipeError, match="unknown slot"):
        register("anything", "userpkg.models:loaders")


@pytest.mark.parametrize("extra", ["torch", "torch.utils", "nnx_es", "nnx_es.recipes"])
def test_allow_cannot_name_torch_or_nnx_es(extra) -> None:
    with pytest.raises(RecipeError, match="--allow names your own package"):
        Allowed([extra])


@pytest.mark.parametrize(("tensor", "message"), [
    ({"@tensor": [1.0, 2.0], "dtype": "onnx"}, "dtype 'onnx' is not one of"),
    ({"@tensor": [1.0, 2.0], "dtype": "_dynamo"}, "dtype '_dynamo' is not one of"),
    ({"@tensor": [1.0, 2.0], "dtype": ["float32"]}, "dtype"),
    ({"@tensor": [1.0, [2.0]]}, "is no float32 tensor"),
    ({"@tensor": [1.0, "a"]}, "holds str"),
    ({"@tensor": [0.0] * (MAX_TENSOR_VALUES + 1)}, "more than"),
    ({"@tensor": {"a": 1}}, "holds dict"),
])
def test_a_bad_tensor_marker_is_a_recipe_error_naming_it(tensor, message) -> None:
    with pytest.raises(RecipeError, match=message):
        from_spec(recipe("torch.nn.modules.loss:CrossEntropyLoss", weight=tensor), slot="loss")


def test_a_tensor_dtype_imports_nothing() -> None:
    code = textwrap.dedent("""
        import sys
        from nnx_es.errors import RecipeError
        from nnx_es.recipes import Recipe, from_spec
        before = set(sys.modules)
        for dtype in ("onnx", "_dynamo", "distributed", "fx"):
            try:
                from_spec(Recipe(target="torch.nn.modules.loss:CrossEntropyLoss",
                                 kwargs={"weight": {"@tensor": [1.0], "dtype": dtype}}), slot="loss")
            except RecipeError:
                pass
            else:
                raise SystemExit("built")
        new = sorted(m for m in set(sys.modules) - before if m.startswith("torch."))
        print(new)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_deeply_nested_json_is_a_recipe_error_not_a_recursion_error() -> None:
    spec = msgspec.to_builtins(scaffold(epochs=1))
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    spec["model"]["kwargs"]["hidden"] = deep
    with pytest.raises(RecipeError, match="nested deeper than 32"):
        decode_spec(msgspec.json.encode(spec))
    with pytest.raises(RecipeError, match="nested deeper than 32"):
        from_spec({"target": "nnx_es.recipes.models:MLP", "kwargs": {"hidden": deep}})
    text = b'{"model": {"@type": "recipe", "target": "a:b", "kwargs": {"x": ' + b"[" * 10**5 + b"]" * 10**5 + b"}}}"
    with pytest.raises(RecipeError, match="nested too deep"):
        decode_spec(text)


def test_a_model_recipe_that_is_no_module_is_refused_before_anything_is_built() -> None:
    spec = msgspec.to_builtins(scaffold(epochs=1))
    spec["model"] = {"@type": "recipe", "target": "nnx_es.monitor:Monitor", "kwargs": {"name": "val_loss"}}
    with pytest.raises(UnsafeRecipeError, match="spec model: .*nnx_es.monitor:Monitor.*model"):
        validate_spec(decode_spec(spec), Allowed())


def test_a_constructor_refusing_its_arguments_is_a_recipe_error_naming_the_recipe() -> None:
    with pytest.raises(RecipeError, match="torch.nn.modules.linear:Linear: TypeError"):
        from_spec(recipe("torch.nn.modules.linear:Linear", in_features="a", out_features=2), slot="model")


def test_the_readmes_recipe_and_every_scaffold_build(tmp_path) -> None:
    net = torch.nn.Linear(2, 2)
    adam = from_spec({"@type": "recipe", "target": "torch.optim.adam:Adam", "kwargs": {"lr": 0.003,
                     "params": {"@params": None}}}, slot="optimizer", context=BuildContext(net=net))
    assert isinstance(adam, torch.optim.Adam)
    for kwargs in ({}, {"dataset": "breast_cancer"}, {"val_fraction": 0.0}, {"hidden": (64, 32)}):
        validate_spec(decode_spec(msgspec.json.encode(scaffold(epochs=2, **kwargs))), Allowed())


def test_a_spec_path_that_is_a_fifo_or_too_big_is_refused_without_reading_it(tmp_path) -> None:
    import os

    from nnx_es.recipes.runspec import MAX_SPEC_BYTES, load_spec

    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(RecipeError, match="not a regular file"):
        load_spec(tmp_path / "fifo.json")  # never opened for a blocking read: no writer, no hang
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(MAX_SPEC_BYTES + 1)
    with pytest.raises(RecipeError, match="more than"):
        load_spec(tmp_path / "big.json")
    with pytest.raises(RecipeError, match="cannot read spec"):
        load_spec(tmp_path / "missing.json")


def test_a_callback_at_a_path_it_does_not_live_at_is_refused_unimported_with_the_slots_own_path_suggested() -> None:
    recipe = Recipe(target="nnx_es.diagnostics:Diagnostics", kwargs={})
    with pytest.raises(UnsafeRecipeError) as refused:
        from_spec(recipe, allowed=Allowed(), slot="callback")
    assert str(refused.value) == (
        "recipe path 'nnx_es.diagnostics:Diagnostics' is not a callback: a subclass of nnx_es.callbacks:Callback or a "
        "factory registered for it; refused, nothing imported (did you mean 'nnx_es.diagnostics.recorder:Diagnostics'?)")
    with pytest.raises(UnsafeRecipeError) as refused:  # no class of the slot by that name: no suggestion
        from_spec(Recipe(target="nnx_es.diagnostics:Nothing", kwargs={}), allowed=Allowed(), slot="callback")
    assert str(refused.value).endswith("refused, nothing imported")
    with pytest.raises(UnsafeRecipeError) as refused:  # imported (a trusted home): what it is, is named
        from_spec(Recipe(target="nnx_es.callbacks:CallbackList", kwargs={}), allowed=Allowed(), slot="callback")
    assert str(refused.value).startswith("recipe path 'nnx_es.callbacks:CallbackList' is the class "
                                         "'nnx_es.callbacks.CallbackList', not a callback")


@pytest.mark.parametrize("field, value, said", [
    ("metrics", ["acuracy"], "unknown metrics ['acuracy']; known: ['accuracy']"),
    ("monitor", "val_los", "monitor 'val_los' names no reported metric"),
    ("format", 2, "spec format: 2 is not a spec format this version reads (supported: 1)"),
], ids=["unknown_metric", "unknown_monitor", "unknown_format"])
def test_report_refuses_what_run_refuses_without_data(tmp_path, capsys, field, value, said) -> None:
    """Before: nnx-es report said "valid" (and a format 2 spec even ran)."""
    from nnx_es.cli.main import main
    from nnx_es.errors import NnxError
    from nnx_es.recipes.runspec import build_run

    spec = msgspec.to_builtins(scaffold(epochs=1))
    if field == "monitor":
        spec["monitor"]["kwargs"]["name"] = value
    else:
        spec[field] = value
    path = tmp_path / "spec.json"
    path.write_bytes(msgspec.json.encode(spec))
    assert main(["report", str(path), "--png", str(tmp_path / "lr.png")]) == 2
    err = capsys.readouterr()
    assert said in err.err and "valid" not in err.out and "Traceback" not in err.err
    with pytest.raises(NnxError, match=re.escape(said)):  # what run says, from the same check
        build_run(decode_spec(spec), runs_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
