"""Overrides of a spec by dotted path: what an experiment plan's grid and a search space set.

A path names one place of a :class:`~nnx_es.recipes.runspec.RunSpec` that holds plain data:
``"optimizers.main.kwargs.lr"``, ``"model.kwargs.hidden.0"``, ``"schedulers.0.kwargs.scheduler.kwargs.factor"``,
``"trainer.checkpoint_lag"``, ``"epochs"``, ``"seed"``. It can never name code:

* the top-level fields it may enter are the spec's recipes (:data:`~nnx_es.recipes.runspec.FIELD_SLOTS`),
  ``trainer`` (one of :data:`~nnx_es.recipes.runspec.TRAINER_SETTINGS`), ``metrics``, ``epochs`` and
  ``seed``; never ``steps`` (functions by import path) or ``format``;
* inside a recipe it goes through ``kwargs`` only (never ``target``), and the keyword it sets must
  take plain data by the recipe resolver's own rule (:func:`~nnx_es.recipes.slots.parameter_slot`
  of the target, resolved for its slot through the import guard): a keyword that takes a recipe or
  a function (an optimizer, an inner scheduler, an ``lr_lambda``) is refused, though a path may go
  *through* the recipe standing there to one of its plain keywords;
* no part of it starts with ``@`` and it never replaces a marker (``{"@params": ...}``,
  ``{"@optimizer": ...}``);
* the value is JSON data: ``None``, a bool, an int, a finite float, a string, or a list of those
  (nested); never a mapping (which could hold a recipe or a marker).

The spec that results is decoded and validated again like any spec
(:func:`~nnx_es.recipes.runspec.validate_spec`), so a value of the wrong type or a keyword the
target does not take is named before anything is built.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from nnx_es.errors import RecipeError, UnsafeRecipeError
from nnx_es.recipes.imports import Allowed
from nnx_es.recipes.runspec import FIELD_SLOTS, TRAINER_SETTINGS, RunSpec, decode_spec, validate_spec
from nnx_es.recipes.slots import Slot, parameter_slot, slot

__all__ = ["MAX_PATH_PARTS", "apply_overrides", "check_path", "check_value", "label", "value_at"]

#: the most dotted parts a path may have (a spec nests recipes a few levels deep)
MAX_PATH_PARTS = 16
#: top-level fields that are plain data of their own (set whole)
_SCALARS = ("epochs", "seed")
_PART = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _parts(path: Any) -> list[str]:
    if not isinstance(path, str) or not path:
        raise RecipeError(f"an override path is a dotted string such as 'optimizers.main.kwargs.lr', got {path!r}")
    parts = path.split(".")
    if len(parts) > MAX_PATH_PARTS or not all(_PART.fullmatch(p) for p in parts):
        raise RecipeError(f"override path {path!r}: each dotted part is a name or an index (letters, digits, '_', "
                          f"'-'; never '@'), at most {MAX_PATH_PARTS} parts")
    return parts


def label(overrides: Mapping[str, Any]) -> str:
    """``overrides`` in a few words: each path by its last name (``lr``, ``hidden.0``) ``=`` its value
    (a float to 4 significant digits)."""
    words = []
    for path, value in overrides.items():
        parts = path.split(".")
        short = ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
        words.append(f"{short}={value:.4g}" if isinstance(value, float) else f"{short}={value}")
    return " ".join(words)


def check_value(path: str, value: Any, depth: int = 0) -> None:
    """Refuse an override value that is not plain JSON data.

    Raises:
        RecipeError: a mapping (it could hold a recipe or a marker), a non-finite float, another type,
            or lists nested deeper than 8; naming the path and the value.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RecipeError(f"override {path!r}: {value!r} is not a finite number")
        return
    if isinstance(value, (list, tuple)) and depth < 8:
        for v in value:
            check_value(path, v, depth + 1)
        return
    raise RecipeError(f"override {path!r}: the value must be plain data (null, a bool, a number, a string or a list "
                      f"of them), got {type(value).__name__} {str(value)[:80]!r}")


def _is_recipe(value: Any) -> bool:
    return isinstance(value, dict) and value.get("@type") == "recipe" and isinstance(value.get("target"), str)


def _index(container: Any, part: str, path: str, *, append: bool = False) -> Any:
    """The key of ``container`` that ``part`` names: an int index into a list, a key of a mapping."""
    if isinstance(container, list):
        if not part.isdigit() or int(part) >= len(container) + (1 if append else 0):
            raise RecipeError(f"override path {path!r}: {part!r} is no index of a list of {len(container)}")
        return int(part)
    if isinstance(container, dict):
        if any(isinstance(k, str) and k.startswith("@") for k in container):
            raise UnsafeRecipeError(f"override path {path!r}: {part!r} is inside a marker ({sorted(container)[0]}); "
                                    "a marker is the runtime's reference to the net or an optimizer, refused")
        return part
    raise RecipeError(f"override path {path!r}: {part!r} goes into {type(container).__name__} "
                      f"{str(container)[:60]!r}, which has no parts")


def _plain(container: Any, parts: list[str], path: str, value: Any, *, write: bool) -> Any:
    """Walk plain data ``container`` along ``parts``; set ``value`` at the end when ``write`` (else read it)."""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        key = _index(container, part, path)
        if last:
            current = container[key] if isinstance(container, list) or key in container else None
            if isinstance(current, dict) and (any(str(k).startswith("@") for k in current) or _is_recipe(current)):
                raise UnsafeRecipeError(f"override path {path!r} would replace a recipe or marker with plain data; "
                                        "refused (a space or a plan sets plain data only)")
            if write:
                container[key] = value
            return current
        if isinstance(container, dict) and key not in container:
            raise RecipeError(f"override path {path!r}: the spec has nothing at {'.'.join(parts[:i + 1])!r}")
        container = container[key]
    raise RecipeError(f"override path {path!r} names no value")  # unreachable: parts is never empty


def _recipe(recipe: Any, parts: list[str], where: list[str], path: str, want: Slot, allowed: Allowed,
            value: Any, write: bool) -> Any:
    """Go into ``recipe`` (standing in slot ``want``) along ``parts``; set or read a plain keyword."""
    if not _is_recipe(recipe):
        raise RecipeError(f"override path {path!r}: {'.'.join(where)} is not a recipe")
    if len(parts) < 2 or parts[0] != "kwargs":
        said = "names the recipe's import path (code)" if parts and parts[0] == "target" else "does not go through kwargs"
        raise UnsafeRecipeError(f"override path {path!r} {said}: a path into a recipe names one of its keywords, "
                                f"{'.'.join(where)}.kwargs.<keyword>; a space or a plan sets plain data only: refused")
    keyword, rest = parts[1], parts[2:]
    if want.name == "optimizer" and keyword == "params":
        raise UnsafeRecipeError(f"override path {path!r}: an optimizer's params are the net's parameters (the runtime's "
                                "@params marker), not plain data; refused (set a group's keyword, e.g. its lr)")
    target = allowed.resolve(recipe["target"], want)
    inner_slot = parameter_slot(target, keyword)
    kwargs = recipe.setdefault("kwargs", {})
    if inner_slot is None:  # the keyword takes plain data: set it (or a part of it)
        return _plain(kwargs, [keyword, *rest], path, value, write=write)
    if not rest:
        raise UnsafeRecipeError(
            f"override path {path!r}: keyword {keyword!r} of {recipe['target']} takes {inner_slot.describe()}, not "
            "plain data; refused (a path may go through the recipe standing there to one of its plain keywords)")
    inner, at = kwargs.get(keyword), [*where, "kwargs", keyword]
    if isinstance(inner, list) or (isinstance(inner, dict) and not _is_recipe(inner)):  # recipes by index or name
        key = _index(inner, rest[0], path)
        if isinstance(inner, dict) and key not in inner:
            raise RecipeError(f"override path {path!r}: the spec has no {rest[0]!r} at {'.'.join(at)}")
        inner, at, rest = inner[key], [*at, rest[0]], rest[1:]
    return _recipe(inner, rest, at, path, inner_slot, allowed, value, write)


def _walk(document: dict[str, Any], path: str, value: Any, allowed: Allowed, *, write: bool) -> Any:
    parts = _parts(path)
    top, rest = parts[0], parts[1:]
    if top in _SCALARS:
        if rest:
            raise RecipeError(f"override path {path!r}: {top!r} is a number, it has no parts")
        return _plain(document, [top], path, value, write=write)
    if top == "trainer":
        if len(rest) != 1 or rest[0] not in TRAINER_SETTINGS:
            raise RecipeError(f"override path {path!r}: trainer.<setting> names one of {', '.join(TRAINER_SETTINGS)}")
        return _plain(document.setdefault("trainer", {}), rest, path, value, write=write)
    if top == "metrics":
        return _plain(document, parts, path, value, write=write)
    if top not in FIELD_SLOTS:
        why = ("names step functions by import path (code)" if top == "steps"
               else f"is not a field an override may set (recipes: {', '.join(FIELD_SLOTS)}; trainer, metrics, "
                    f"{', '.join(_SCALARS)})")
        raise UnsafeRecipeError(f"override path {path!r}: {top!r} {why}; refused")
    field = document.get(top)
    where = [top]
    if isinstance(field, (list, dict)) and not _is_recipe(field):  # optimizers by name, schedulers/callbacks/hooks by index
        if not rest:
            raise UnsafeRecipeError(f"override path {path!r}: {top!r} holds recipes; name one and a keyword of it: "
                                    "refused")
        key = _index(field, rest[0], path)
        if isinstance(field, dict) and key not in field:
            raise RecipeError(f"override path {path!r}: the spec has no {top} entry {rest[0]!r} (it has "
                              f"{', '.join(map(str, field)) or 'none'})")
        field, where, rest = field[key], [top, rest[0]], rest[1:]
    if field is None:
        raise RecipeError(f"override path {path!r}: the spec has no {top}")
    return _recipe(field, rest, where, path, slot(FIELD_SLOTS[top]), allowed, value, write)


def check_path(spec: RunSpec, path: str, allowed: Allowed) -> None:
    """Refuse ``path`` unless it names a place of ``spec`` that holds plain data (the module docstring).

    ``spec`` must have passed :func:`~nnx_es.recipes.runspec.validate_spec` with ``allowed``: the recipes
    along the path are resolved (imported) for their slots to type their keywords.

    Raises:
        UnsafeRecipeError: the path names code, a recipe or a marker; RecipeError: it names nothing.
    """
    _walk(msgspec.to_builtins(spec), path, None, allowed, write=False)


def value_at(spec: RunSpec | Mapping[str, Any], path: str) -> Any:
    """The value ``spec`` (a spec or its JSON document, e.g. a run's stored ``run_started.spec``) holds at
    ``path``: the path read as keys and indices of the spec's JSON; None where nothing is (an unset keyword).

    Raises:
        RecipeError: a malformed path.
    """
    value: Any = msgspec.to_builtins(spec)
    for part in _parts(path):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def apply_overrides(spec: RunSpec, overrides: Mapping[str, Any], allowed: Allowed | None = None) -> RunSpec:
    """``spec`` with each ``path: value`` of ``overrides`` set, decoded and validated again like any spec.

    ``spec`` is validated first (its recipes type the paths' keywords); ``spec`` itself is not changed.

    Raises:
        UnsafeRecipeError: a path that names code (``target``, ``steps``), a keyword that takes a recipe or a
            function, a marker, or a recipe of the base spec refused by the import guard.
        RecipeError: a path that names nothing, a value that is not plain data, or a resulting spec that
            does not decode or validate (a value of the wrong type, a keyword the target does not take).
        ConfigError: a resulting ``epochs`` out of range.
    """
    allowed = allowed or Allowed()
    validate_spec(spec, allowed)
    document = msgspec.to_builtins(spec)
    for path, value in overrides.items():
        check_value(path, value)
        _walk(document, path, msgspec.to_builtins(value), allowed, write=True)
    new = decode_spec(document)
    try:
        validate_spec(new, allowed)
    except RecipeError as exc:
        raise type(exc)(f"with overrides {dict(overrides)!r}: {exc}") from None
    return new
