"""A run as one JSON document: :class:`RunSpec` (model, optimizers and their parameter groups,
schedulers, loss terms, callbacks, hooks, monitor, data, step functions, cadences, epochs, seed).

* :func:`record_spec`: what ``Trainer(..., recipe_required=True)`` stores in ``run_started.spec``
  (with its SHA-256 in ``spec_hash``), read back from the live objects; whatever cannot be
  recovered (a model argument, a lambda step function) is refused before training, named.
* :func:`build_run`: a trainer and its loaders from a spec, every import through the guard.
* :func:`scaffold`: the complete spec ``nnx-es init`` writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from nnx_es.errors import RecipeError
from nnx_es.recipes.core import BuildContext, Recipe, as_recipe, check_signature, from_spec, recipe_hash, to_spec, walk_paths
from nnx_es.recipes.imports import Allowed, path_of

__all__ = ["STEP_FUNCTIONS", "TRAINER_SETTINGS", "BuiltRun", "RunSpec", "build_run", "decode_spec", "load_spec", "spec_hash",
           "record_spec", "scaffold", "validate_spec"]

#: Trainer keywords a spec's ``trainer`` section may set
TRAINER_SETTINGS = ("validate_every", "validate_every_steps", "phase_every", "keep_phases", "checkpoint_lag",
                    "sample_weights", "track_grad_norm", "batch_gather", "keep_last", "keep_best", "nonfinite")
#: step functions a spec names by import path
STEP_FUNCTIONS = ("train_step_fn", "eval_step_fn", "trainer_step_fn")


class RunSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything needed to rebuild a run. Recipes are ``{"@type": "recipe", "target", "kwargs"}``.

    optimizers: by name; an optimizer recipe without ``params`` takes all the model's parameters,
    ``{"@params": [{"names": [...], <overrides>}, ...]}`` names its groups. schedulers: recipes of
    :class:`nnx_es.Scheduler` (a torch scheduler with its clock), their optimizer given as
    ``{"@optimizer": name}``. loss: a loss recipe or an :class:`nnx_es.Objective` of named terms.
    data: a recipe returning ``(train_loader, val_loader or None)``. steps: step function -> path.
    """

    model: Recipe
    optimizers: dict[str, Recipe]
    loss: Recipe
    schedulers: list[Recipe] = []
    callbacks: list[Recipe] = []
    hooks: list[Recipe] = []
    monitor: Recipe | None = None
    metrics: list[str] = []
    data: Recipe | None = None
    steps: dict[str, str] = {}
    trainer: dict[str, Any] = {}
    epochs: int = 10
    seed: int = 0
    format: int = 1


def decode_spec(document: Any) -> RunSpec:
    """A :class:`RunSpec` from JSON bytes/str or builtins.

    Raises:
        RecipeError: not JSON, or a field of the wrong type or unknown (named with its path, ``$.model.kwargs``).
    """
    try:
        if isinstance(document, (bytes, str)):
            return msgspec.json.decode(document, type=RunSpec)
        return msgspec.convert(document, RunSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RecipeError(f"bad spec: {exc}") from None


def load_spec(path: str | Path) -> RunSpec:
    """Read and decode the spec file at ``path``.

    Raises:
        RecipeError: the file cannot be read, or see :func:`decode_spec` (the file named).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RecipeError(f"cannot read spec {str(path)!r}: {exc.strerror or exc}") from None
    try:
        spec = decode_spec(data)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    return spec


def validate_spec(spec: RunSpec, allowed: Allowed) -> None:
    """Check every path (text first, for all of them, then the import) and every recipe's keywords
    against its target's signature, without building anything or loading data.

    Raises:
        UnsafeRecipeError / RecipeError: naming the path or keyword.
    """
    for path in walk_paths(msgspec.to_builtins(spec)):
        allowed.check_text(path)
    for path in spec.steps.values():
        allowed.check_text(path)
    unknown = sorted(set(spec.steps) - set(STEP_FUNCTIONS))
    if unknown:
        raise RecipeError(f"spec steps: unknown step function {unknown[0]!r} (known: {', '.join(STEP_FUNCTIONS)})")
    unknown = sorted(set(spec.trainer) - set(TRAINER_SETTINGS))
    if unknown:
        raise RecipeError(f"spec trainer: unknown setting {unknown[0]!r} (known: {', '.join(TRAINER_SETTINGS)})")
    for recipe in _recipes(msgspec.to_builtins(spec)):
        target = allowed.resolve(recipe.target)
        check_signature(target, recipe.kwargs, recipe.target)
    for path in spec.steps.values():
        allowed.resolve(path)


def _recipes(value: Any) -> list[Recipe]:
    out: list[Recipe] = []
    if isinstance(value, Mapping):
        if value.get("@type") == "recipe":
            out.append(as_recipe({k: v for k, v in value.items() if k != "@type"}))
        for v in value.values():
            out.extend(_recipes(v))
    elif isinstance(value, list):
        for v in value:
            out.extend(_recipes(v))
    return out


@dataclass
class BuiltRun:
    """A trainer built from a spec, its loaders and its epochs."""

    trainer: Any
    train_loader: Any
    val_loader: Any
    epochs: int
    spec: RunSpec


def build_run(spec: RunSpec, *, allowed: Allowed | None = None, runs_root: str | Path = "runs",
              run_id: str | None = None, progress: bool | None = None) -> BuiltRun:
    """Build the trainer and loaders ``spec`` describes (the model first, then its optimizers...).

    The trainer records ``spec`` (``recipe_required=True``), so its ``run_started`` can rebuild the run.

    Raises:
        UnsafeRecipeError / RecipeError: see :func:`validate_spec`; ConfigError: a bad value.
    """
    import nnx_es

    allowed = allowed or Allowed()
    validate_spec(spec, allowed)
    if spec.data is None:
        raise RecipeError("spec data: a spec run from the command line needs a data recipe")
    net = from_spec(spec.model, allowed=allowed)
    ctx = BuildContext(net=net)
    for name, recipe in spec.optimizers.items():
        if "params" not in recipe.kwargs:
            recipe = Recipe(target=recipe.target, kwargs={**recipe.kwargs, "params": {"@params": None}})
        ctx.optimizers[name] = from_spec(recipe, allowed=allowed, context=ctx)
    build = lambda r: from_spec(r, allowed=allowed, context=ctx)  # noqa: E731
    loaders = build(spec.data)
    if not (isinstance(loaders, Sequence) and len(loaders) == 2):
        raise RecipeError(f"spec data: {spec.data.target} must return (train_loader, val_loader or None)")
    steps = {k: allowed.resolve(v) for k, v in spec.steps.items()}
    trainer = nnx_es.Trainer(
        net, dict(ctx.optimizers), build(spec.loss), monitor=build(spec.monitor) if spec.monitor else None,
        metrics=tuple(spec.metrics), schedulers=[build(r) for r in spec.schedulers],
        callbacks=[build(r) for r in spec.callbacks], hooks=[build(r) for r in spec.hooks],
        **steps, **spec.trainer, runs_root=runs_root, run_id=run_id, seed=spec.seed, progress=progress,
        recipe_required=True, spec=spec,
    )
    return BuiltRun(trainer, loaders[0], loaders[1], spec.epochs, spec)


def record_spec(required: bool, given: RunSpec | Mapping[str, Any] | None, *, net: Any, optimizers: Mapping[str, Any],
                objective: Any, monitor: Any, metrics: Sequence[str], schedulers: Sequence[Any],
                callbacks: Sequence[Any], update_hooks: Sequence[Any], hooks: Sequence[Any],
                steps: Mapping[str, Any], settings: Mapping[str, Any], seed: int) -> dict[str, Any] | None:
    """The spec a trainer records in ``run_started``, read back from its live components; None
    when no recipe is required and none was given.

    ``given`` (a spec the trainer was built from) contributes its data and epochs; every component
    is read from the live objects (an object built from a recipe gives that recipe back).

    Raises:
        RecipeError: a component whose recipe cannot be recovered -- the model's constructor
            argument, a lambda or local step function -- named, before training starts.
    """
    if not required and given is None:
        return None
    if given is not None and not isinstance(given, RunSpec):
        given = decode_spec(given)
    opts = dict(optimizers)
    try:
        model = to_spec(net)
    except RecipeError as exc:
        raise RecipeError(f"a recipe is required and the model's cannot be recovered: {exc}") from None
    stage_hooks = [h for h in hooks if not any(h is u for u in update_hooks)]
    step_paths = {}
    for name, fn in steps.items():
        if fn is not None:
            try:
                step_paths[name] = path_of(fn)
            except RecipeError as exc:
                raise RecipeError(f"a recipe is required: {name}: {exc}") from None
    spec = RunSpec(
        model=model,
        optimizers={name: to_spec(o, net=net) for name, o in opts.items()},
        loss=to_spec(objective, net=net, optimizers=opts),
        schedulers=[to_spec(s, net=net, optimizers=opts) for s in schedulers],
        callbacks=[to_spec(c, net=net, optimizers=opts) for c in callbacks],
        hooks=[to_spec(h, net=net, optimizers=opts) for h in [*update_hooks, *stage_hooks]],
        monitor=to_spec(monitor) if monitor is not None else None,
        metrics=list(metrics), steps=step_paths, trainer={k: v for k, v in settings.items() if k in TRAINER_SETTINGS},
        data=given.data if given is not None else None, epochs=given.epochs if given is not None else 0, seed=seed,
    )
    return msgspec.to_builtins(spec)  # type: ignore[no-any-return]


def spec_hash(document: Mapping[str, Any] | None) -> str:
    """The SHA-256 ``run_started.spec_hash`` holds ("" without a spec)."""
    return recipe_hash(document) if document is not None else ""


def scaffold(*, dataset: str = "digits", model: str = "mlp", lr: float = 3e-3, epochs: int = 20, seed: int = 0,
             batch_size: int = 32, hidden: Sequence[int] = (128,), patience: int = 6,
             val_fraction: float = 0.2) -> RunSpec:
    """The complete spec ``nnx-es init`` writes: the digits main job by default (an MLP, Adam,
    ReduceLROnPlateau and EarlyStopping on ``val_loss``, BEST).

    Raises:
        RecipeError: an unknown model; ConfigError: an unknown data set.
    """
    from nnx_es.recipes.data import dataset_shape

    if model != "mlp":
        raise RecipeError(f"--model must be 'mlp', got {model!r} (write another model's recipe into the spec)")
    features, classes = dataset_shape(dataset)
    validated = val_fraction > 0
    r = Recipe
    return RunSpec(
        model=r(target="nnx_es.recipes.models:MLP",
                kwargs={"in_features": features, "out_features": classes, "hidden": list(hidden)}),
        optimizers={"main": r(target="torch.optim.adam:Adam", kwargs={"lr": lr})},
        loss=r(target="torch.nn.modules.loss:CrossEntropyLoss", kwargs={}),
        schedulers=[r(target="nnx_es.schedulers:Scheduler", kwargs={
            "scheduler": r(target="torch.optim.lr_scheduler:ReduceLROnPlateau",
                           kwargs={"optimizer": {"@optimizer": "main"}, "mode": "min", "factor": 0.5, "patience": 3}),
            "clock": "epoch", "name": "plateau"})] if validated else [],
        callbacks=[r(target="nnx_es.callbacks:EarlyStopping", kwargs={"patience": patience})] if validated else [],
        monitor=r(target="nnx_es.monitor:Monitor", kwargs={"name": "val_loss", "mode": "min", "min_delta": 1e-4})
        if validated else None,
        metrics=["accuracy"],
        data=r(target="nnx_es.recipes.data:tabular", kwargs={
            "dataset": dataset, "batch_size": batch_size, "val_fraction": val_fraction, "seed": seed}),
        trainer={"keep_phases": 3, "phase_every": 5},
        epochs=epochs, seed=seed,
    )
