"""A search space as data: a JSON object mapping a dotted spec path to a distribution.

    {"optimizers.main.kwargs.lr": {"float": [1e-4, 1e-1], "log": true},
     "model.kwargs.hidden.0":     {"int": [16, 256], "log": true},
     "data.kwargs.batch_size":    {"categorical": [16, 32, 64]}}

* ``{"float": [low, high]}``, with ``"log": true`` (low > 0) or ``"step": s``: Optuna's ``suggest_float``;
* ``{"int": [low, high]}``, with ``"log"`` or ``"step"``: ``suggest_int`` (both ends included);
* ``{"categorical": [choices]}``: ``suggest_categorical``; each choice null, a bool, a number or a string.

The parameter's name in the study is its path. A path sets plain data only and every trial's spec
is validated like any spec (:mod:`nnx_es.recipes.overrides`). The space is someone else's input: it
is checked whole (keys, types, bounds) before the study is opened, and nothing in it is ever code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from nnx_es.errors import ConfigError, RecipeError
from nnx_es.recipes.runspec import read_document

__all__ = ["Dist", "parse_space", "space_json", "suggest"]

#: the most parameters a space may have (and choices a categorical may list)
MAX_PARAMS = 64
MAX_CHOICES = 1024


class Dist(msgspec.Struct, frozen=True, kw_only=True):
    """One parameter's distribution. kind: ``float`` | ``int`` | ``categorical``; low / high: the bounds
    (both included); log / step: as Optuna's ``suggest_float`` / ``suggest_int``; choices: a categorical's."""

    kind: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple[Any, ...] = ()

    def example(self) -> Any:
        """A value of the distribution (its low end, or first choice): what the space is checked with."""
        return self.choices[0] if self.kind == "categorical" else self.low

    def as_json(self) -> dict[str, Any]:
        """The distribution as the space file writes it."""
        if self.kind == "categorical":
            return {"categorical": list(self.choices)}
        out: dict[str, Any] = {self.kind: [self.low, self.high]}
        if self.log:
            out["log"] = True
        if self.step is not None:
            out["step"] = self.step
        return out


def _number(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int) and abs(value) < 2**63
    return isinstance(value, (int, float)) and math.isfinite(value)


def _dist(path: str, spec: Any) -> Dist:
    where = f"space {path!r}"
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: a distribution is {{'float': [low, high]}}, {{'int': [low, high]}} or "
                          f"{{'categorical': [choices]}}, got {spec!r}")
    kinds = [k for k in ("float", "int", "categorical") if k in spec]
    unknown = sorted(set(spec) - {"float", "int", "categorical", "log", "step"})
    if len(kinds) != 1 or unknown:
        raise ConfigError(f"{where}: give exactly one of float, int, categorical (and log / step), got keys "
                          f"{sorted(spec)}")
    kind = kinds[0]
    if kind == "categorical":
        choices = spec["categorical"]
        if set(spec) != {"categorical"}:
            raise ConfigError(f"{where}: a categorical takes no log or step")
        if not isinstance(choices, list) or not 1 <= len(choices) <= MAX_CHOICES or not all(
                c is None or isinstance(c, (bool, int, str)) or (isinstance(c, float) and math.isfinite(c))
                for c in choices):
            raise ConfigError(f"{where}: categorical takes a list of 1 to {MAX_CHOICES} choices, each null, a bool, a "
                              f"finite number or a string, got {choices!r}")
        return Dist(kind=kind, choices=tuple(choices))
    bounds, log, step = spec[kind], spec.get("log", False), spec.get("step")
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(_number(b, kind) for b in bounds)
            and bounds[0] <= bounds[1]):
        raise ConfigError(f"{where}: {kind} takes [low, high], {kind}s with low <= high, got {bounds!r}")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log takes true or false, got {log!r}")
    if log and (bounds[0] <= 0 or step is not None):
        raise ConfigError(f"{where}: a log scale needs low > 0 and no step, got {bounds!r}, step {step!r}")
    if step is not None and not (_number(step, kind) and step > 0):
        raise ConfigError(f"{where}: step takes a {kind} > 0, got {step!r}")
    return Dist(kind=kind, low=bounds[0], high=bounds[1], log=log, step=step)


def parse_space(space: Mapping[str, Any] | str | Path) -> dict[str, Dist]:
    """The distributions of ``space`` (a mapping, or a JSON file's path), checked whole.

    Raises:
        ConfigError: an empty space, more than :data:`MAX_PARAMS` parameters, a path that is not a string,
            or a distribution that is malformed (named with its path).
        RecipeError: the file cannot be read or is not JSON.
    """
    if isinstance(space, (str, Path)):
        try:
            space = msgspec.json.decode(read_document(space, "space"))
        except msgspec.DecodeError as exc:
            raise RecipeError(f"space {str(space)!r} is not JSON: {exc}") from None
        except RecursionError:
            raise RecipeError(f"space {str(space)!r}: nested too deep to decode; a space is a flat object") from None
    if not isinstance(space, Mapping) or not space or len(space) > MAX_PARAMS:
        raise ConfigError(f"a search space maps 1 to {MAX_PARAMS} dotted spec paths to distributions, got "
                          f"{str(space)[:80]!r}")
    out = {}
    for path, spec in space.items():
        if not isinstance(path, str):
            raise ConfigError(f"a search space's keys are dotted spec paths, got {path!r}")
        out[path] = _dist(path, spec)
    return out


def space_json(space: Mapping[str, Dist]) -> dict[str, Any]:
    """``space`` as the JSON it was read from (what a study records to refuse another space under its name)."""
    return {path: d.as_json() for path, d in space.items()}


def suggest(trial: Any, path: str, dist: Dist) -> Any:
    """Ask Optuna ``trial`` for ``path``'s value (a resumed trial gets the value it had: Optuna keeps it)."""
    if dist.kind == "float":
        return trial.suggest_float(path, dist.low, dist.high, log=dist.log, step=dist.step)
    if dist.kind == "int":
        return trial.suggest_int(path, dist.low, dist.high, log=dist.log, step=dist.step or 1)
    return trial.suggest_categorical(path, list(dist.choices))
