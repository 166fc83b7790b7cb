"""A recipe: an import path plus constructor keyword arguments, as JSON -- never a pickle.

:func:`to_spec` reads a live object's recipe back from it: an object built by
:func:`from_spec` gives the recipe it was built from; one that defines ``recipe_kwargs()``
gives those; otherwise every parameter of its constructor is read from the attribute of
the same name (``self.<arg> = <arg>``, the habit that makes a class reproducible; a few
torch classes that store an argument under another name are read through a table). An
argument that cannot be recovered is refused, named -- never guessed.

Values in ``kwargs`` are JSON builtins or one of these markers::

    {"@type": "recipe", "target": ..., "kwargs": {...}}   a nested object, built first
    {"@ref": "module:name"}                               a class or function, by import path
    {"@optimizer": "main"}                                the run's optimizer of that name
    {"@params": [{"names": [...], "lr": ...}, ...]}       the net's parameters, in groups, by name
    {"@tensor": [...], "dtype": "float32"}                a small tensor (a loss's class weights)

:func:`from_spec` imports every path through :class:`~nnx_es.recipes.imports.Allowed` (checked
before importing: nothing outside the allowed prefixes is imported) and binds the keywords to
the target's signature, so a misspelt keyword is named at once.
"""

from __future__ import annotations

import hashlib
import inspect
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from torch import nn
from torch.optim import Optimizer

from nnx_es.errors import RecipeError
from nnx_es.recipes.imports import Allowed, path_of

__all__ = ["BuildContext", "Recipe", "check_signature", "from_spec", "recipe_hash", "to_spec", "walk_paths"]


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
_ENCODER = msgspec.json.Encoder(order="sorted")


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
    """SHA-256 (hex) of ``document``'s canonical JSON (sorted keys): what ``run_started.spec_hash`` holds."""
    return hashlib.sha256(_ENCODER.encode(document)).hexdigest()


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
              context: BuildContext | None = None) -> Any:
    """Build what ``recipe`` describes; the result's :func:`to_spec` is ``recipe`` again.

    Every path the recipe names is checked against ``allowed`` (default: ``torch``, ``nnx_es``)
    before anything is imported.

    Raises:
        UnsafeRecipeError: a path outside the allowed prefixes, private, denied, or an alias.
        RecipeError: a path that does not import, a keyword the target does not take, a
            marker with nothing to refer to.
    """
    allowed = allowed or Allowed()
    recipe = as_recipe(recipe)
    for path in walk_paths(recipe):  # every path, before the first import
        allowed.check_text(path)
    return _build(recipe, allowed, context or BuildContext())


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


def _build(recipe: Recipe, allowed: Allowed, context: BuildContext) -> Any:
    target = allowed.resolve(recipe.target)
    kwargs = {k: _decode(v, allowed, context, f"{recipe.target}({k}=...)") for k, v in recipe.kwargs.items()}
    check_signature(target, kwargs, recipe.target, partial=False)
    obj = target(**kwargs)
    if _weakrefable(obj):
        _BUILT[obj] = _normal(recipe)
    return obj


def _decode(value: Any, allowed: Allowed, context: BuildContext, where: str) -> Any:
    if isinstance(value, Recipe):
        return _build(value, allowed, context)
    if isinstance(value, list):
        return [_decode(v, allowed, context, where) for v in value]
    if not isinstance(value, Mapping):
        return value
    if value.get("@type") == "recipe":
        return _build(as_recipe({k: v for k, v in value.items() if k != "@type"}), allowed, context)
    if "@ref" in value:
        return allowed.resolve(value["@ref"])
    if "@optimizer" in value:
        opt = context.optimizers.get(value["@optimizer"])
        if opt is None:
            raise RecipeError(f"{where}: no optimizer named {value['@optimizer']!r} (the run has "
                              f"{sorted(context.optimizers)})")
        return opt
    if "@tensor" in value:
        return torch.tensor(value["@tensor"], dtype=getattr(torch, str(value.get("dtype", "float32"))))
    if "@params" in value:
        return _param_groups(value["@params"], context, where)
    return {k: _decode(v, allowed, context, where) for k, v in value.items()}


def _param_groups(groups: Any, context: BuildContext, where: str) -> Any:
    if context.net is None:
        raise RecipeError(f"{where}: parameter groups need the net")
    named = dict(context.net.named_parameters())
    if groups is None:
        return list(named.values())
    out = []
    for group in groups:
        unknown = [n for n in group.get("names", []) if n not in named]
        if unknown:
            raise RecipeError(f"{where}: the net has no parameter {unknown[0]!r}")
        out.append({"params": [named[n] for n in group["names"]],
                    **{k: (tuple(v) if isinstance(v, list) else v) for k, v in group.items() if k != "names"}})
    return out
