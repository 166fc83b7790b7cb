"""A recipe: an import path plus constructor keyword arguments, as JSON -- never a pickle.

:func:`to_spec` reads a live object's recipe back from it: an object built by
:func:`from_spec` gives the recipe it was built from; one that defines ``recipe_kwargs()``
gives those; otherwise every parameter of its constructor is read from the attribute of
the same name (``self.<arg> = <arg>``, the habit that makes a class reproducible; a few
torch classes that store an argument under another name are read through a table). An
argument that cannot be recovered is refused, named -- never guessed.

Values in ``kwargs`` are JSON builtins or one of these markers::

    {"@type": "recipe", "target": ..., "kwargs": {...}}   a nested object, built first
    {"@ref": "module:name"}                               a function, by import path
    {"@optimizer": "main"}                                the run's optimizer of that name
    {"@params": [{"names": [...], "lr": ...}, ...]}       the net's parameters, in groups, by name
    {"@tensor": [...], "dtype": "float32"}                a small tensor (a loss's class weights)

Recipes are instantiated by type, not by module (:mod:`nnx_es.recipes.slots`): a recipe resolves
only to a class of the base its slot expects, or to a factory registered for the slot; a nested
recipe is typed by its parameter (a table for trusted classes, else the annotation) and an
``@ref`` only stands where a function is expected (an ``lr_lambda``, a ``LambdaCallback`` hook,
a per-row loss). A keyword that declares no class takes plain data and markers only.
``@tensor`` takes the dtypes of :data:`TENSOR_DTYPES` and at most :data:`MAX_TENSOR_VALUES` values.

:func:`from_spec` checks every path's text before importing anything (allowed prefixes, a place
some slot keeps its types), resolves each for its slot through
:class:`~nnx_es.recipes.imports.Allowed`, and binds the keywords to the target's signature, so a
misspelt keyword is named at once.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from torch import nn
from torch.optim import Optimizer

from events.specs import canonical_hash
from nnx_es.errors import NnxError, RecipeError, UnsafeRecipeError
from nnx_es.recipes.imports import Allowed, path_of
from nnx_es.recipes.slots import COMPONENT, Slot, component, known_anywhere, parameter_slot
from nnx_es.recipes.slots import slot as get_slot

__all__ = ["MAX_DEPTH", "TENSOR_DTYPES", "BuildContext", "Recipe", "check_depth", "check_paths", "check_signature",
           "from_spec", "recipe_hash", "to_spec", "validate_recipe", "walk_paths"]

#: how deep a recipe's JSON may nest (recipes inside recipes, lists, mappings)
MAX_DEPTH = 32


class Recipe(msgspec.Struct, frozen=True, kw_only=True, tag="recipe", tag_field="@type"):
    """What to build: ``target`` (``"module:Qualified.name"``) called with ``kwargs``."""

    target: str
    kwargs: dict[str, Any] = {}


@dataclass
class BuildContext:
    """What markers refer to while building: the net (``@params``) and the optimizers by name (``@optimizer``)."""

    net: nn.Module | None = None
    optimizers: dict[str, Optimizer] = field(default_factory=dict)


#: objects built by :func:`from_spec` -> the recipe they were built from
_BUILT: weakref.WeakKeyDictionary[Any, Recipe] = weakref.WeakKeyDictionary()
#: constructor arguments that are run state or deprecated: left out when the object has no such attribute
_SKIP = frozenset({"last_epoch", "verbose", "size_average", "reduce", "device", "dtype"})


def _min_lr(s: Any) -> Any:
    lrs = list(s.min_lrs)
    return lrs[0] if len(set(lrs)) == 1 else lrs


def _lr_lambda(s: Any) -> Any:
    fns = list(s.lr_lambdas)
    return fns[0] if len(fns) == 1 else fns


#: (class path, argument) -> how to read it back, for torch classes that store it under another name
_RECOVER = {
    ("torch.optim.lr_scheduler:ReduceLROnPlateau", "min_lr"): _min_lr,
    ("torch.optim.lr_scheduler:MultiStepLR", "milestones"): lambda s: sorted(s.milestones.elements()),
    ("torch.optim.lr_scheduler:LambdaLR", "lr_lambda"): _lr_lambda,
    ("torch.optim.lr_scheduler:MultiplicativeLR", "lr_lambda"): _lr_lambda,
}


def recipe_hash(document: Any) -> str:
    """SHA-256 (hex) of ``document``'s canonical JSON (sorted keys): what ``run_started.spec_hash`` holds
    (:func:`events.specs.canonical_hash`)."""
    return canonical_hash(document)


# --- live object -> recipe ---------------------------------------------------------------


def to_spec(obj: Any, *, net: nn.Module | None = None, optimizers: Mapping[str, Optimizer] | None = None) -> Recipe:
    """The recipe that rebuilds ``obj`` (see the module docstring for how it is read).

    ``net``: the model whose parameters an optimizer's groups name; ``optimizers``: by name,
    for objects that hold an optimizer (a scheduler).

    Raises:
        RecipeError: an argument that cannot be recovered or encoded (named, with the class),
            a lambda or local function, or an optimizer over parameters ``net`` does not hold.
    """
    built = _BUILT.get(obj) if _weakrefable(obj) else None
    if built is not None:
        return built
    opts = dict(optimizers or {})
    if isinstance(obj, Optimizer):
        return _optimizer_spec(obj, net)
    target = path_of(type(obj))
    where = target
    custom = getattr(obj, "recipe_kwargs", None)
    if callable(custom):
        raw = dict(custom())
    else:
        raw = {}
        for name, p in inspect.signature(type(obj)).parameters.items():
            if p.kind is p.VAR_KEYWORD:
                continue
            if p.kind is p.VAR_POSITIONAL:
                raise RecipeError(f"{where}: its constructor takes *{name}, which cannot be recovered from the object; "
                                  "give the class a recipe_kwargs() method")
            recover = _RECOVER.get((target, name))
            if recover is not None:
                raw[name] = recover(obj)
            elif hasattr(obj, name):
                raw[name] = getattr(obj, name)
            elif name in _SKIP and p.default is not p.empty:
                continue
            else:
                raise RecipeError(
                    f"{where}: constructor argument {name!r} cannot be recovered (the object has no attribute "
                    f"{name!r}); store it as self.{name} = {name}, or give the class a recipe_kwargs() method"
                )
    kwargs = {k: _encode(v, f"{where}({k}=...)", net, opts) for k, v in raw.items()}
    return _normal(Recipe(target=target, kwargs=kwargs))


def _normal(recipe: Recipe) -> Recipe:
    """``recipe`` with nested recipes as their JSON mappings: one form, so equal recipes compare equal."""
    return Recipe(target=recipe.target, kwargs=msgspec.to_builtins(recipe.kwargs))


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _encode(value: Any, where: str, net: nn.Module | None, optimizers: dict[str, Optimizer]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Recipe):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(v, where, net, optimizers) for v in value]
    if isinstance(value, Optimizer):
        name = next((n for n, o in optimizers.items() if o is value), None)
        if name is None:
            raise RecipeError(f"{where}: holds an optimizer the run does not name")
        return {"@optimizer": name}
    if isinstance(value, torch.Tensor):
        if value.numel() > 4096:
            raise RecipeError(f"{where}: a tensor of {value.numel()} values is too big for a recipe")
        return {"@tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise RecipeError(f"{where}: a mapping with non-string keys cannot be recorded")
        return {k: _encode(v, where, net, optimizers) for k, v in value.items()}
    if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
        try:
            return {"@ref": path_of(value)}
        except RecipeError as exc:
            raise RecipeError(f"{where}: {exc}") from None
    try:
        return to_spec(value, net=net, optimizers=optimizers)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def _optimizer_spec(opt: Optimizer, net: nn.Module | None) -> Recipe:
    target = path_of(type(opt))
    if net is None:
        raise RecipeError(f"{target}: an optimizer's recipe names its parameters, which needs the net")
    names = {id(p): n for n, p in net.named_parameters()}
    accepted = set(inspect.signature(type(opt)).parameters) - {"params"}
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
    groups = []
    for i, group in enumerate(opt.param_groups):
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise RecipeError(f"{target}: parameter group {i} holds {len(missing)} parameter(s) the net does not have")
        entry: dict[str, Any] = {"names": [names[id(p)] for p in group["params"]]}
        entry.update({k: v for k, v in group.items() if k in defaults and k != "params" and v != defaults[k]})
        groups.append(entry)
    kwargs = {k: _encode(v, f"{target}({k}=...)", net, {}) for k, v in defaults.items()}
    kwargs["params"] = {"@params": [{k: _encode(v, target, net, {}) for k, v in g.items()} for g in groups]}
    return _normal(Recipe(target=target, kwargs=kwargs))


# --- recipe -> object --------------------------------------------------------------------


def walk_paths(value: Any) -> list[str]:
    """Every import path ``value`` (a recipe, or JSON holding recipes) names, outermost first."""
    out: list[str] = []
    if isinstance(value, Recipe):
        out.append(value.target)
        out.extend(walk_paths(value.kwargs))
    elif isinstance(value, Mapping):
        if value.get("@type") == "recipe":
            out.append(value.get("target"))  # type: ignore[arg-type]
        if "@ref" in value:
            out.append(value["@ref"])
        for v in value.values():
            out.extend(walk_paths(v))
    elif isinstance(value, list):
        for v in value:
            out.extend(walk_paths(v))
    return out


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse JSON nested deeper than ``limit`` (a recipe's keywords, a spec), without recursing.

    Raises:
        RecipeError: naming where and the limit.
    """
    todo: list[tuple[Any, int]] = [(msgspec.to_builtins(value) if isinstance(value, msgspec.Struct) else value, 0)]
    while todo:
        item, depth = todo.pop()
        if depth > limit:
            raise RecipeError(f"{where}: nested deeper than {limit} levels; a recipe's keywords are plain data "
                              "and recipes a few levels deep")
        if isinstance(item, Recipe):
            todo.append((item.kwargs, depth + 1))
        elif isinstance(item, Mapping):
            todo.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend((v, depth + 1) for v in item)


def check_paths(value: Any, allowed: Allowed, slot: Slot | None = None) -> None:
    """Every path ``value`` names, checked from its text before the first import: allowed, and able to
    stand in some slot (``slot`` for the outermost recipe). See :mod:`nnx_es.recipes.slots`.

    Raises:
        UnsafeRecipeError: naming the first path refused; nothing was imported.
    """
    paths = walk_paths(value)
    for i, path in enumerate(paths):
        module, qualname = allowed.check_text(path, slot if i == 0 and isinstance(value, Recipe) else None)
        dotted = module + ("." + qualname if qualname else "")
        if not known_anywhere(dotted, allowed.user):
            raise UnsafeRecipeError(
                f"recipe path {path!r} is no class or factory any slot of a spec takes (a model, an optimizer, a "
                "scheduler, a loss, a callback, a hook, the monitor, data) nor in a package --allow names; "
                "refused, nothing imported")


def check_signature(target: Any, kwargs: Mapping[str, Any], path: str, *, partial: bool = True) -> None:
    """Refuse keywords ``target``'s signature does not take (and, unless ``partial``, missing ones).

    Raises:
        RecipeError: naming the keyword and the accepted ones.
    """
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin without a signature: checked when called
    try:
        (sig.bind_partial if partial else sig.bind)(**kwargs)
    except TypeError as exc:
        accepted = [n for n, p in sig.parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise RecipeError(f"recipe {path}: {exc} (it takes {', '.join(accepted)})") from None


def from_spec(recipe: Recipe | Mapping[str, Any], *, allowed: Allowed | None = None,
              context: BuildContext | None = None, slot: str = COMPONENT) -> Any:
    """Build what ``recipe`` describes; the result's :func:`to_spec` is ``recipe`` again.

    ``slot``: the place it stands in a spec (:data:`~nnx_es.recipes.slots.SLOTS`: ``"model"``,
    ``"optimizer"``, ``"scheduler"``, ``"loss"``, ``"callback"``, ``"hook"``, ``"monitor"``,
    ``"data"``); the default takes any of them. Every path the recipe names is checked against
    ``allowed`` and the registry before anything is imported; each nested recipe is built for
    the slot its parameter declares (:func:`~nnx_es.recipes.slots.parameter_slot`).

    Raises:
        UnsafeRecipeError: a path outside the allowed prefixes, private, denied, an alias, or not of
            its slot (a class of another base, a function nobody registered).
        RecipeError: a path that does not import, a keyword the target does not take, a
            marker with nothing to refer to, JSON nested too deep, or the constructor refused its
            arguments (its error named).
    """
    allowed = allowed or Allowed()
    recipe = as_recipe(recipe)
    check_depth(recipe, recipe.target)
    expected = component() if slot == COMPONENT else get_slot(slot)
    check_paths(recipe, allowed, expected)  # every path, before the first import
    return _build(recipe, expected, allowed, context or BuildContext())


def as_recipe(value: Recipe | Mapping[str, Any]) -> Recipe:
    """A :class:`Recipe` from itself or its JSON mapping (``{"target": ..., "kwargs": ...}``)."""
    if isinstance(value, Recipe):
        return value
    if not isinstance(value, Mapping):
        raise RecipeError(f"a recipe is {{'target': 'module:Name', 'kwargs': {{...}}}}, got {value!r}")
    try:
        return msgspec.convert({"@type": "recipe", **value}, Recipe)
    except msgspec.ValidationError as exc:
        raise RecipeError(f"malformed recipe {dict(value)!r}: {exc}") from None


def validate_recipe(recipe: Recipe | Mapping[str, Any], *, allowed: Allowed | None = None,
                    slot: str = COMPONENT) -> None:
    """What :func:`from_spec` checks, building nothing: every path (text, then the import and its type,
    nested ones for their parameter's slot), the markers, and the keywords each target takes (missing
    ones are not refused: a target may default them).

    Raises:
        UnsafeRecipeError / RecipeError: as :func:`from_spec`.
    """
    allowed = allowed or Allowed()
    recipe = as_recipe(recipe)
    check_depth(recipe, recipe.target)
    expected = component() if slot == COMPONENT else get_slot(slot)
    check_paths(recipe, allowed, expected)
    _build(recipe, expected, allowed, None)


def _build(recipe: Recipe, slot: Slot, allowed: Allowed, context: BuildContext | None) -> Any:
    """Build ``recipe`` for ``slot`` (``context`` None: check it, build nothing, return None)."""
    target = allowed.resolve(recipe.target, slot)
    kwargs = {k: _decode(v, parameter_slot(target, k), allowed, context, f"{recipe.target}({k}=...)")
              for k, v in recipe.kwargs.items()}
    check_signature(target, kwargs, recipe.target, partial=context is None)
    if context is None:
        return None
    try:
        obj = target(**kwargs)
    except NnxError:
        raise
    except Exception as exc:  # a constructor refusing its arguments: the recipe's fault, said in one line
        raise RecipeError(f"recipe {recipe.target}: {type(exc).__name__}: {exc}") from None
    bases = slot.classes() if slot.takes_recipe else ()
    if not inspect.isclass(target) and bases and not isinstance(obj, bases):
        raise RecipeError(f"recipe {recipe.target}: the factory returned {type(obj).__name__}, not {slot.describe()}")
    if _weakrefable(obj):
        _BUILT[obj] = _normal(recipe)
    return obj


#: the dtypes a ``{"@tensor": ..., "dtype": ...}`` may name
TENSOR_DTYPES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")}
#: the most values a ``@tensor`` holds (a loss's class weights, not data)
MAX_TENSOR_VALUES = 4096


def _decode(value: Any, slot: Slot | None, allowed: Allowed, context: BuildContext | None, where: str) -> Any:
    """``value`` (JSON) as the keyword it is for: a recipe is built for ``slot``, an ``@ref`` resolved for
    it; with no slot (plain data) only numbers, strings, lists, mappings and the markers pass.
    ``context`` None: check only (the references to the run's net and optimizers are not looked up)."""
    if isinstance(value, Recipe) or (isinstance(value, Mapping) and value.get("@type") == "recipe"):
        if slot is None or not slot.takes_recipe:
            raise UnsafeRecipeError(
                f"{where}: a recipe is not accepted here: the parameter takes "
                f"{'plain data (it declares no class)' if slot is None else slot.describe() + ' by @ref'}; refused")
        recipe = value if isinstance(value, Recipe) else as_recipe({k: v for k, v in value.items() if k != "@type"})
        return _build(recipe, slot, allowed, context)
    if isinstance(value, list):
        return [_decode(v, slot, allowed, context, where) for v in value]
    if not isinstance(value, Mapping):
        return value
    if "@ref" in value:
        if slot is None or not slot.takes_ref:
            raise UnsafeRecipeError(f"{where}: @ref {value['@ref']!r} is not accepted here: only a parameter that "
                                    "takes a function (an lr_lambda, a LambdaCallback hook, a loss function) takes "
                                    "an @ref; refused")
        return allowed.resolve(value["@ref"], slot.functions_only())
    if context is None and ("@optimizer" in value or "@params" in value):
        return value
    if "@optimizer" in value:
        opt = context.optimizers.get(value["@optimizer"]) if isinstance(value["@optimizer"], str) else None
        if opt is None:
            raise RecipeError(f"{where}: no optimizer named {value['@optimizer']!r} (the run has "
                              f"{sorted(context.optimizers)})")
        return opt
    if "@tensor" in value:
        return _tensor(value, where)
    if "@params" in value:
        return _param_groups(value["@params"], context, where)
    return {k: _decode(v, slot, allowed, context, where) for k, v in value.items()}


def _tensor(value: Mapping[str, Any], where: str) -> torch.Tensor:
    """A ``{"@tensor": nested lists of numbers, "dtype": one of TENSOR_DTYPES}`` marker.

    Raises:
        RecipeError: an unknown dtype, more than MAX_TENSOR_VALUES values, or values that are no tensor.
    """
    dtype = value.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
        raise RecipeError(f"{where}: @tensor dtype {dtype!r} is not one of {', '.join(TENSOR_DTYPES)}")
    data, count, todo = value["@tensor"], 0, [value["@tensor"]]
    while todo:
        item = todo.pop()
        if isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, bool) or not isinstance(item, (int, float)):
            raise RecipeError(f"{where}: @tensor holds {type(item).__name__} {item!r}; it takes nested lists of "
                              "numbers")
        else:
            count += 1
        if count > MAX_TENSOR_VALUES or len(todo) > MAX_TENSOR_VALUES:
            raise RecipeError(f"{where}: @tensor holds more than {MAX_TENSOR_VALUES} values; too big for a recipe")
    try:
        return torch.tensor(data, dtype=TENSOR_DTYPES[dtype])
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise RecipeError(f"{where}: @tensor {str(data)[:60]!r} is no {dtype} tensor: {exc}") from None


def _param_groups(groups: Any, context: BuildContext, where: str) -> Any:
    if context.net is None:
        raise RecipeError(f"{where}: parameter groups need the net")
    named = dict(context.net.named_parameters())
    if groups is None:
        return list(named.values())
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("names", []), list)
                                               for g in groups):
        raise RecipeError(f"{where}: @params takes null or a list of {{'names': [...], <overrides>}}, got {groups!r}")
    out = []
    for group in groups:
        unknown = [n for n in group.get("names", []) if not isinstance(n, str) or n not in named]
        if unknown:
            raise RecipeError(f"{where}: the net has no parameter {unknown[0]!r}")
        out.append({"params": [named[n] for n in group["names"]],
                    **{k: (tuple(v) if isinstance(v, list) else v) for k, v in group.items() if k != "names"}})
    return out
