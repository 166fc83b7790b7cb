"""Checks of ``Trainer`` arguments (argument checks, not the validation pass): each refuses a bad
value by name (:class:`~nnx_es.errors.ConfigError`) before anything is built or written."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import nn
from torch.optim import Optimizer

from nnx_es.errors import ConfigError
from nnx_es.monitor import Monitor
from nnx_es.progress import Progress

#: what a non-finite loss, gradient or validation metric does (``Trainer(nonfinite=...)``)
NONFINITE = ("skip", "stop", "raise")

#: ``fit(resume_mode=...)``: continue the run itself, or start a new run from its weights or its whole state
RESUME_MODES = ("stateful", "weights_only", "fork")

__all__ = ["BATCH_CALLBACK_KEYWORDS", "MAX_EPOCHS", "as_number", "check_batch_callback", "check_cadences", "check_epochs",
           "check_fit_args", "check_recipe",
           "check_run_args",
           "monitor_of", "optimizers_of"]


def as_number(value: Any) -> float:
    """``value`` as a float when it is a number (Python, NumPy, a 0-dim tensor), else NaN (a bool,
    a string, a tensor of several elements, anything ``float()`` refuses): callers refuse NaN by name."""
    if isinstance(value, (bool, str, bytes)):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        return math.nan


#: the largest epoch budget: far past any run, and an int every event and counter holds
MAX_EPOCHS = 2**31 - 1


def check_epochs(epochs: Any, what: str = "epochs") -> int:
    """``epochs`` (a budget, 0-based epochs ``0 .. epochs - 1``) when it is an int in ``[0, MAX_EPOCHS]``.

    Raises:
        ConfigError: naming ``what`` (``epochs``, ``--epochs``, ``spec epochs``) and the value.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or not 0 <= epochs <= MAX_EPOCHS:
        shown = repr(epochs) if len(repr(epochs)) <= 40 else repr(epochs)[:37] + "..."
        raise ConfigError(f"{what} must be an int in [0, {MAX_EPOCHS}], got {shown}; nothing was trained or written")
    return epochs


def check_cadences(*, validate_every: int, validate_every_steps: int | None, phase_every: int | None,
                   keep_phases: int | None) -> None:
    """Validation and phase-checkpoint cadences (epochs; ``validate_every_steps`` in updates).

    Raises:
        ConfigError: a cadence below 1, or ``keep_phases`` without ``phase_every``.
    """
    for name, value, unit, optional in (("validate_every", validate_every, "epoch", False),
                                        ("phase_every", phase_every, "epoch", True),
                                        ("keep_phases", keep_phases, "checkpoint", True),
                                        ("validate_every_steps", validate_every_steps, "update", True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1 {unit}{' or None' if optional else ''}, got {value!r}")
    if keep_phases is not None and phase_every is None:
        raise ConfigError("keep_phases needs phase_every (phase checkpoints every N epochs) to rotate anything")


def check_settings(*, loss: Any, callbacks: Any, final_validation: Any, sample_weights: Any, nonfinite: Any,
                   sinks: Any, track_grad_norm: Any) -> None:
    """The Trainer's arguments of these names, each alone.

    Raises:
        ConfigError: ``loss`` neither a loss module, a callable, a mapping nor an Objective; ``callbacks``
            not a list; ``final_validation`` not True, False or ``"auto"``; ``sample_weights`` or
            ``track_grad_norm`` not a bool; ``nonfinite`` not ``"skip"``, ``"stop"`` or ``"raise"``;
            ``sinks`` not a list of objects with ``write`` (each named with the value received).
    """
    if not (isinstance(loss, (Mapping, nn.Module)) or callable(loss)):  # an Objective is callable
        raise ConfigError(f"loss must be a loss module, a callable, {{name: fn}} or an Objective, got {loss!r}")
    if not isinstance(callbacks, Iterable):  # a Callback itself is not
        raise ConfigError(f"callbacks must be a list of Callback, got {callbacks!r}")
    if final_validation not in (True, False, "auto"):
        raise ConfigError(f"final_validation must be True, False or 'auto', got {final_validation!r}")
    if not isinstance(sample_weights, bool):
        raise ConfigError(f"sample_weights must be True or False, got {sample_weights!r}")
    if nonfinite not in NONFINITE:
        raise ConfigError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable) or not all(
            callable(getattr(s, "write", None)) for s in sinks):
        raise ConfigError(f"sinks must be a list of live logging sinks (TensorBoardSink, CsvSink, MlflowSink or "
                          f"objects with open/write/close), got {sinks!r}")
    if not isinstance(track_grad_norm, bool):
        raise ConfigError(f"track_grad_norm must be True or False, got {track_grad_norm!r}")


def check_run_args(*, runs_root: Any, seed: Any, progress: Any, batch_gather: Any,
                   recipe: Mapping[str, Any] | None) -> None:
    """Where and how a run is recorded.

    Raises:
        ConfigError: ``runs_root`` is a file; ``seed`` is not an int in [-2**63, 2**64);
            ``progress`` is not True, False or None; ``batch_gather`` is not a bool; a
            ``recipe`` value cannot be recorded (:func:`check_recipe`).
    """
    root = Path(runs_root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"runs_root must be a directory, got the file {str(root)!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -(2**63) <= seed < 2**64:
        raise ConfigError(f"seed must be an int in [-2**63, 2**64) (torch.manual_seed's range), got {seed!r}")
    Progress(progress)  # refuses a value other than True, False or None
    if not isinstance(batch_gather, bool):
        raise ConfigError(f"batch_gather must be True or False, got {batch_gather!r}")
    if recipe is not None and not isinstance(recipe, Mapping):
        raise ConfigError(f"recipe must be a dict of str keys (JSON-like values) or None, got {recipe!r}")
    check_recipe(dict(recipe or {}))


def check_recipe(recipe: Mapping[str, Any]) -> None:
    """Refuse a recipe ``run_started`` could not record (JSON-like builtins only).

    Raises:
        ConfigError: naming the first key whose value msgspec cannot encode.
    """
    advice = "keep the recipe to JSON-like builtins (str keys; str, numbers, bools, None, lists, dicts)"
    for key, value in recipe.items():
        if not isinstance(key, str):
            raise ConfigError(f"recipe key {key!r} is not a str: run_started records str keys; {advice}")
        try:  # as run_started encodes it, and back
            msgspec.msgpack.decode(msgspec.msgpack.encode({key: value}), type=dict[str, Any])
        except (TypeError, OverflowError, msgspec.EncodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"recipe[{key!r}] cannot be recorded ({exc}); {advice}") from None


def optimizers_of(net: nn.Module, optimizer: Any, *, custom_step: bool) -> dict[str, Optimizer]:
    """``Trainer(optimizer=...)`` as ``{name: optimizer}`` (one optimizer is named for its class).

    Raises:
        ConfigError: not an optimizer or a non-empty mapping of them; an optimizer holding
            parameters that are not ``net``'s; an LBFGS without a custom ``trainer_step_fn``.
    """
    if isinstance(optimizer, Optimizer):
        optimizer = {type(optimizer).__name__.lower(): optimizer}
    if (not isinstance(optimizer, Mapping) or not optimizer
            or not all(isinstance(o, Optimizer) for o in optimizer.values())):
        raise ConfigError(f"optimizer must be a torch Optimizer or a non-empty {{name: Optimizer}}, got {optimizer!r}")
    own = {id(p) for p in net.parameters()}
    for name, opt in optimizer.items():
        foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise ConfigError(
                f"optimizer {name!r} holds {foreign} parameter(s) that are not the net's: build it over "
                "net.parameters(), or it would step nothing the net uses"
            )
    closure = [n for n, o in optimizer.items() if isinstance(o, torch.optim.LBFGS)]
    if closure and not custom_step:
        raise ConfigError(f"optimizer {closure[0]!r} is LBFGS, whose step() re-evaluates the loss through a "
                          "closure; the update engine steps once per window without one: pass a trainer_step_fn "
                          "that calls opt.step(closure) and ctx.report_update(...)")
    return dict(optimizer)


#: the keyword-only parameters of a per-batch validation callback (spec 004)
BATCH_CALLBACK_KEYWORDS = ("batch", "predictions", "loss", "batch_count", "step_count", "epoch")


def check_batch_callback(fn: Any) -> Any:
    """Return ``fn`` after checking it takes ``(*, batch, predictions, loss, batch_count, step_count, epoch)``
    (or ``**kwargs``); None passes.

    Raises:
        ConfigError: not callable, or a parameter missing / not keyword-accepting / extra and required (named).
    """
    if fn is None:
        return None
    if not callable(fn):
        raise ConfigError(f"val_batch_callback must be callable, got {fn!r}")
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn  # a builtin without a signature: called as documented
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn
    missing = [k for k in BATCH_CALLBACK_KEYWORDS if k not in params or params[k].kind is params[k].POSITIONAL_ONLY]
    extra = [n for n, p in params.items() if n not in BATCH_CALLBACK_KEYWORDS and p.default is p.empty
             and p.kind is not p.VAR_POSITIONAL]
    if missing or extra:
        raise ConfigError(f"val_batch_callback must take the keyword arguments (*, {', '.join(BATCH_CALLBACK_KEYWORDS)}); "
                          f"{fn!r} lacks {missing} and requires {extra}")
    return fn


def monitor_of(monitor: Monitor | str | None, higher_is_better: Mapping[str, bool] | None = None) -> Monitor | None:
    """``Trainer(monitor=...)`` as a :class:`~nnx_es.monitor.Monitor` (a name containing ``acc``
    is maximized, any other minimized, unless ``higher_is_better`` -- metric name without
    ``val_`` -> whether larger is better, as a metric declares it -- says otherwise).

    Raises:
        ConfigError: neither a Monitor, a metric name nor None.
    """
    if isinstance(monitor, str):
        said = (higher_is_better or {}).get(monitor.removeprefix("val_"))
        maximize = said if said is not None else "acc" in monitor
        monitor = Monitor(monitor, mode="max" if maximize else "min")
    if monitor is not None and not isinstance(monitor, Monitor):
        raise ConfigError(f"monitor must be a Monitor or a metric name, got {monitor!r}")
    return monitor


def check_fit_args(train_loader: Any, val_loader: Any, *, epochs: Any, monitor: Monitor | None, resume_mode: str,
                   resume: str | None, resume_from: Any, run_id: str | None, distributed: Any) -> None:
    """``Trainer.fit``'s arguments against the trainer's (its ``monitor``, ``run_id``, ``distributed``),
    before anything is written.

    Raises:
        ConfigError: bad ``epochs``/``resume_mode``/``resume`` (a ``resume_mode`` other than ``"stateful"``
            without ``resume_from`` included; ``resume="auto"`` without a ``run_id`` or with ``resume_from``),
            a ``val_`` monitor without a validation loader, an empty train or validation loader (under DDP
            a rank's validation shard may be empty).
    """
    from nnx_es.loaders import length_of

    check_epochs(epochs)
    if val_loader is None and monitor is not None and monitor.name.startswith("val_"):
        raise ConfigError(f"monitor {monitor.name!r} needs a validation loader: fit(train, val, ...)")
    if resume_mode not in RESUME_MODES:
        raise ConfigError(f"resume_mode must be one of {RESUME_MODES}, got {resume_mode!r}")
    if resume not in (None, "auto"):
        raise ConfigError(f"resume must be None or 'auto', got {resume!r}")
    if resume_mode != "stateful" and resume_from is None:
        raise ConfigError(f"resume_mode={resume_mode!r} starts a new run from another run's checkpoint: give "
                          "resume_from=runs/<id> (and this trainer a run_id of its own); resume='auto' always "
                          "continues this trainer's own run statefully; nothing was trained or written")
    if resume == "auto" and (run_id is None or resume_from is not None):
        raise ConfigError("resume='auto' continues this trainer's own run: give Trainer(run_id=...) and no "
                          f"resume_from (got run_id={run_id!r}, resume_from={resume_from!r})")
    for role, loader in (("train_loader", train_loader), ("val_loader", val_loader)):
        if loader is not None and length_of(loader) == 0 and not (role == "val_loader" and distributed):
            # (under DDP a rank's validation shard may be empty: validation_loader does not pad)
            raise ConfigError(f"{role} has no batch (len 0): an empty data set, or drop_last=True with fewer "
                              "rows than batch_size; nothing was trained or written")
