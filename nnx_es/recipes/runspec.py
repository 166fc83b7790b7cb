"""A run as one JSON document: :class:`RunSpec` (model, optimizers and their parameter groups,
schedulers, loss terms, callbacks, hooks, monitor, data, step functions, cadences, epochs, seed).

* :func:`record_spec`: what ``Trainer(..., recipe_required=True)`` stores in ``run_started.spec``
  (with its SHA-256 in ``spec_hash``), read back from the live objects; whatever cannot be
  recovered (a model argument, a lambda step function) is refused before training, named.
* :func:`build_run`: a trainer and its loaders from a spec, every import through the guard, each
  recipe built for its field's slot (:data:`FIELD_SLOTS`, :mod:`nnx_es.recipes.slots`);
* :func:`spec_of_run`: the spec a run recorded, its ``spec_hash`` verified: a stored spec is as
  untrusted as a file on the command line and goes through the same :func:`validate_spec`;
* :func:`scaffold`: the complete spec ``nnx-es init`` writes.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from events.specs import spec_hash, spec_hash_problem
from nnx_es.argchecks import check_epochs
from nnx_es.errors import ConfigError, NnxError, RecipeError
from nnx_es.recipes.core import BuildContext, Recipe, check_depth, check_paths, from_spec, to_spec, validate_recipe
from nnx_es.recipes.imports import Allowed, path_of
from nnx_es.recipes.slots import slot
from nnx_es.rng import seed_everything

__all__ = ["FIELD_SLOTS", "STEP_FUNCTIONS", "TRAINER_SETTINGS", "BuiltRun", "RunSpec", "build_model_and_optimizers",
           "build_run", "decode_spec",
           "load_spec", "read_document", "record_spec", "scaffold", "spec_hash", "spec_of_run", "validate_spec"]

#: Trainer keywords a spec's ``trainer`` section may set
TRAINER_SETTINGS = ("validate_every", "validate_every_steps", "phase_every", "keep_phases", "checkpoint_lag",
                    "sample_weights", "track_grad_norm", "batch_gather", "keep_last", "keep_best", "nonfinite")
#: step functions a spec names by import path
STEP_FUNCTIONS = ("train_step_fn", "eval_step_fn", "trainer_step_fn")
#: each recipe field of a :class:`RunSpec` -> the slot its recipes stand in (steps: the ``"step"`` slot)
FIELD_SLOTS = {"model": "model", "transforms": "transform", "optimizers": "optimizer", "loss": "loss", "schedulers": "scheduler",
               "callbacks": "callback", "hooks": "hook", "monitor": "monitor", "data": "data"}


class RunSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything needed to rebuild a run. Recipes are ``{"@type": "recipe", "target", "kwargs"}``.

    optimizers: by name; an optimizer recipe without ``params`` takes all the model's parameters,
    ``{"@params": [{"names": [...], <overrides>}, ...]}`` names its groups. schedulers: recipes of
    :class:`nnx_es.Scheduler` (a torch scheduler with its clock), their optimizer given as
    ``{"@optimizer": name}``. loss: a loss recipe or an :class:`nnx_es.Objective` of named terms.
    data: a recipe returning ``(train_loader, val_loader or None)``. steps: step function -> path.
    transforms: model transforms (:mod:`nnx_es.transforms`, slot ``"transform"``) applied to the model, in
    order, before its optimizers are built (``Trainer(transforms=...)``); a run recorded without any
    records no ``transforms`` key (its spec and ``spec_hash`` are as before the field existed).
    """

    model: Recipe
    transforms: list[Recipe] = []
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
        RecipeError: not JSON, nested deeper than :data:`~nnx_es.recipes.core.MAX_DEPTH`, or a field of
            the wrong type or unknown (named with its path, ``$.model.kwargs``).
    """
    try:
        if isinstance(document, (bytes, str)):
            spec = msgspec.json.decode(document, type=RunSpec)
        else:
            spec = msgspec.convert(document, RunSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RecipeError(f"bad spec: {exc}") from None
    except RecursionError:
        raise RecipeError("bad spec: nested too deep to decode") from None
    check_depth(spec, "bad spec")
    return spec


#: the largest spec file read (a spec is a page of JSON; this bounds what a hostile one costs)
MAX_SPEC_BYTES = 16 * 2**20


def read_document(path: str | Path, what: str = "spec") -> bytes:
    """The bytes of the JSON file at ``path``: a regular file of at most :data:`MAX_SPEC_BYTES` (a FIFO or
    a device is refused, never read: it could block or never end). ``what`` names it in errors.

    Raises:
        RecipeError: the file cannot be read, is no regular file or is too big.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise RecipeError(f"{what} {str(path)!r} is not a regular file; give a JSON file")
            if st.st_size > MAX_SPEC_BYTES:
                raise RecipeError(f"{what} {str(path)!r} is {st.st_size} bytes, more than {MAX_SPEC_BYTES}: not a "
                                  f"{what}")
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise RecipeError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise RecipeError(f"{what} {str(path)!r} is more than {MAX_SPEC_BYTES} bytes: not a {what}")
    return data


def load_spec(path: str | Path) -> RunSpec:
    """Read and decode the spec file at ``path`` (:func:`read_document`).

    Raises:
        RecipeError: the file cannot be read, is no regular file or is too big, or see :func:`decode_spec`
            (the file named).
    """
    data = read_document(path)
    try:
        spec = decode_spec(data)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None
    return spec


def spec_of_run(started: Any) -> RunSpec | None:
    """The spec a run's ``run_started`` recorded (None: it recorded none), once its ``spec_hash`` matches.

    The spec is then as untrusted as a file given on the command line: build it only through
    :func:`build_run` / :func:`validate_spec`.

    Raises:
        RecipeError: the spec does not hash to ``spec_hash`` (changed after it was written, its
            checksums recomputed), or does not decode (see :func:`decode_spec`).
    """
    problem = spec_hash_problem(started.spec, started.spec_hash)
    if problem is not None:
        raise RecipeError(f"{problem}; refused (give a spec you trust with --spec FILE)")
    return decode_spec(started.spec) if started.spec is not None else None


def _slotted(spec: RunSpec) -> list[tuple[str, Recipe, str]]:
    """(where, recipe, slot) of every recipe field of ``spec``, in :data:`FIELD_SLOTS` order."""
    out = []
    for name, slot_name in FIELD_SLOTS.items():
        value = getattr(spec, name)
        items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list)
                 else [] if value is None else [(None, value)])
        out.extend((f"spec {name}" + (f"[{key!r}]" if key is not None else ""), r, slot_name) for key, r in items)
    return out


def _said(where: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a recipe error it raises prefixed with ``where`` (the spec field)."""
    try:
        return fn(*args, **kwargs)
    except RecipeError as exc:
        raise type(exc)(f"{where}: {exc}") from None


def validate_spec(spec: RunSpec, allowed: Allowed) -> None:
    """Check the counts, every path (its text first, for all of them, then the import and its type for
    its field's slot) and every recipe's keywords against its target's signature, without building
    anything or loading data.

    Raises:
        UnsafeRecipeError / RecipeError: naming the spec field, the path or keyword.
        ConfigError: ``epochs`` out of range.
    """
    check_depth(spec, "spec")
    check_epochs(spec.epochs, "spec epochs")
    unknown = sorted(set(spec.steps) - set(STEP_FUNCTIONS))
    if unknown:
        raise RecipeError(f"spec steps: unknown step function {unknown[0]!r} (known: {', '.join(STEP_FUNCTIONS)})")
    unknown = sorted(set(spec.trainer) - set(TRAINER_SETTINGS))
    if unknown:
        raise RecipeError(f"spec trainer: unknown setting {unknown[0]!r} (known: {', '.join(TRAINER_SETTINGS)})")
    recipes = _slotted(spec)
    for where, recipe, name in recipes:  # every path's text, before the first import
        _said(where, check_paths, recipe, allowed, slot(name))
    for name, path in spec.steps.items():
        _said(f"spec steps[{name!r}]", allowed.check_text, path, slot("step"))
    for where, recipe, name in recipes:
        _said(where, validate_recipe, recipe, allowed=allowed, slot=name)
    for name, path in spec.steps.items():
        _said(f"spec steps[{name!r}]", allowed.resolve, path, slot("step"))


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

    The global RNGs are seeded with ``spec.seed`` first (:func:`nnx_es.rng.seed_everything`), so the
    model's initial weights are the spec's: two runs of one spec are the same run. The trainer
    records ``spec`` (``recipe_required=True``), so its ``run_started`` can rebuild the run.

    Raises:
        UnsafeRecipeError / RecipeError: see :func:`validate_spec`; a constructor refusing its
            arguments (named); ConfigError: a bad value.
    """
    import nnx_es

    allowed = allowed or Allowed()
    validate_spec(spec, allowed)
    if spec.data is None:
        raise RecipeError("spec data: a spec run from the command line needs a data recipe")
    # seeded before anything is built: the model's initial weights (and any draw a recipe makes)
    # come from the spec's seed, so one spec run twice is one run twice (Trainer(seed=) seeds
    # again before training)
    seed_everything(spec.seed)
    net, ctx, transforms = build_model_and_optimizers(spec, allowed)

    def build(where: str, r: Recipe, slot_name: str) -> Any:
        return _said(where, from_spec, r, allowed=allowed, context=ctx, slot=slot_name)

    loaders = build("spec data", spec.data, "data")
    if not (isinstance(loaders, Sequence) and len(loaders) == 2):
        raise RecipeError(f"spec data: {spec.data.target} must return (train_loader, val_loader or None)")
    steps = {k: allowed.resolve(v, slot("step")) for k, v in spec.steps.items()}
    built: dict[str, list[Any]] = {}
    for where, r, name in _slotted(spec):
        if name in ("loss", "scheduler", "callback", "hook", "monitor"):
            built.setdefault(name, []).append(build(where, r, name))
    try:
        trainer = nnx_es.Trainer(
            net, dict(ctx.optimizers), built["loss"][0], monitor=built.get("monitor", [None])[0],
            metrics=tuple(spec.metrics), schedulers=built.get("scheduler", []), callbacks=built.get("callback", []),
            hooks=built.get("hook", []), transforms=transforms,
            **steps, **spec.trainer, runs_root=runs_root, run_id=run_id, seed=spec.seed, progress=progress,
            recipe_required=True, spec=spec,
        )
    except NnxError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # a setting of the wrong type: the spec's fault
        raise ConfigError(f"spec trainer: {type(exc).__name__}: {exc}") from None
    return BuiltRun(trainer, loaders[0], loaders[1], spec.epochs, spec)


def build_model_and_optimizers(spec: RunSpec, allowed: Allowed) -> tuple[Any, BuildContext, list[Any]]:
    """The net (slot ``model``) with the spec's transforms applied (slot ``transform``), then its optimizers
    (slot ``optimizer``; one without ``params`` takes all the net's parameters, adapters included), as
    ``(net, context, transforms)``; what ``nnx-es report`` previews too.

    Raises:
        UnsafeRecipeError / RecipeError: naming the spec field; ConfigError: a transform refuses the net.
    """
    from nnx_es.transforms.callback import prepare

    net = _said("spec model", from_spec, spec.model, allowed=allowed, slot="model")
    transforms = prepare(net, [_said(f"spec transforms[{i}]", from_spec, r, allowed=allowed, slot="transform")
                               for i, r in enumerate(spec.transforms)])
    ctx = BuildContext(net=net)
    for name, recipe in spec.optimizers.items():
        if "params" not in recipe.kwargs:
            recipe = Recipe(target=recipe.target, kwargs={**recipe.kwargs, "params": {"@params": None}})
        ctx.optimizers[name] = _said(f"spec optimizers[{name!r}]", from_spec, recipe, allowed=allowed, context=ctx,
                                     slot="optimizer")
    return net, ctx, transforms


def record_spec(required: bool, given: RunSpec | Mapping[str, Any] | None, *, net: Any, optimizers: Mapping[str, Any],
                objective: Any, monitor: Any, metrics: Sequence[str], schedulers: Sequence[Any],
                callbacks: Sequence[Any], update_hooks: Sequence[Any], hooks: Sequence[Any],
                steps: Mapping[str, Any], settings: Mapping[str, Any], seed: int,
                transforms: Sequence[Any] = ()) -> dict[str, Any] | None:
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
        transforms=[to_spec(t) for t in transforms],
        optimizers={name: to_spec(o, net=net) for name, o in opts.items()},
        loss=to_spec(objective, net=net, optimizers=opts),
        schedulers=[to_spec(s, net=net, optimizers=opts) for s in schedulers],
        callbacks=[to_spec(c, net=net, optimizers=opts) for c in callbacks],
        hooks=[to_spec(h, net=net, optimizers=opts) for h in [*update_hooks, *stage_hooks]],
        monitor=to_spec(monitor) if monitor is not None else None,
        metrics=list(metrics), steps=step_paths, trainer={k: v for k, v in settings.items() if k in TRAINER_SETTINGS},
        data=given.data if given is not None else None, epochs=given.epochs if given is not None else 0, seed=seed,
    )
    document = msgspec.to_builtins(spec)
    if not document["transforms"]:  # a run without transforms records the spec it did before the field
        del document["transforms"]
    _check_recordable(document, "spec")
    return document  # type: ignore[no-any-return]


def _check_recordable(value: Any, where: str) -> None:
    """Refuse a spec value ``run_started`` cannot encode (an int past 64 bits), before anything is written.

    Raises:
        RecipeError: naming the innermost field that does not encode and its value.
    """
    try:
        msgspec.msgpack.encode(value)
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, inner in items:
            _check_recordable(inner, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        raise RecipeError(f"{where} = {repr(value)[:80]} cannot be recorded in run_started ({exc}): an int must lie "
                          "in [-2**63, 2**64)") from None


#: the largest batch size or patience ``nnx-es init`` writes; the widest hidden layer it scaffolds
_MAX_COUNT, _MAX_WIDTH = 2**31 - 1, 2**16


def scaffold(*, dataset: str = "digits", model: str = "mlp", lr: float = 3e-3, epochs: int = 20, seed: int = 0,
             batch_size: int = 32, hidden: Sequence[int] = (128,), patience: int = 6,
             val_fraction: float = 0.2) -> RunSpec:
    """The complete spec ``nnx-es init`` writes: the digits main job by default (an MLP, Adam,
    ReduceLROnPlateau and EarlyStopping on ``val_loss``, BEST).

    Raises:
        RecipeError: an unknown model; ConfigError: an unknown data set, or a count or size out of
            range (``epochs``, ``batch_size``, ``hidden``, ``val_fraction``, ``lr``, ``patience``).
    """
    from nnx_es.recipes.data import dataset_shape

    if model != "mlp":
        raise RecipeError(f"--model must be 'mlp', got {model!r} (write another model's recipe into the spec)")
    check_epochs(epochs, "--epochs")
    for name, value, low in (("--batch-size", batch_size, 1), ("--patience", patience, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _MAX_COUNT:
            raise ConfigError(f"{name} must be an int in [{low}, {_MAX_COUNT}], got {value!r}")
    if any(isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= _MAX_WIDTH for h in hidden):
        raise ConfigError(f"--hidden must be widths in [1, {_MAX_WIDTH}], got {list(hidden)!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction!r}")
    if not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"--lr must be a finite number > 0, got {lr!r}")
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
