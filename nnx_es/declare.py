"""What a run declares about its loss and its optimizers' settings, so that a stateful resume can refuse another.

A stateful resume continues *the same* run: a different loss would make the rest of its history,
BEST and the monitor's decisions compare numbers of another kind, and the run would still end
``completed``. The objective is described by names and settings, never by code: a torch loss
module by its class and its constructor settings (the scalar attributes it keeps, a tensor
setting such as a class ``weight`` by its SHA-256), a function by ``module:qualname``, each with
the term's weight.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["describe_loss", "describe_objective", "describe_optimizers", "optimizer_differences"]

#: module attributes that are state of the module, not settings of the loss
_NOT_SETTINGS = frozenset({"training", "reduction"})


def describe_loss(fn: Any) -> str:
    """``fn`` as a stable string: ``"CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)"``
    for a torch loss module (``reduction`` left out: the objective sets it), ``"pkg.mod:fn"`` for a
    function, the class's ``module:qualname`` for another callable object."""
    if isinstance(fn, nn.Module):
        settings = []
        for key, value in sorted(vars(fn).items()):
            if key.startswith("_") or key in _NOT_SETTINGS:
                continue
            if isinstance(value, (bool, int, float, str)) or value is None:
                settings.append(f"{key}={value!r}")
        for key, buf in sorted(fn.named_buffers(recurse=False)):
            if buf is not None:
                digest = hashlib.sha256(buf.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
                settings.append(f"{key}=sha256:{digest}")
        return f"{type(fn).__name__}({', '.join(settings)})"
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def describe_objective(objective: Any) -> dict[str, str]:
    """Each term of an :class:`~nnx_es.objective.Objective` as ``"<describe_loss> x <weight>"``, by name."""
    return {name: f"{describe_loss(term.fn)} x "
                  f"{term.schedule.describe() if getattr(term, 'schedule', None) is not None else repr(term.weight)}"
            for name, term in objective.terms.items()}


def _plain(value: Any) -> Any:
    """A group setting as plain data (a one-element tensor as its float), or ``_SKIP`` when it is none."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, tuple | list) and all(isinstance(v, bool | int | float) for v in value):
        return list(value)
    return _SKIP


_SKIP = object()
#: group keys that are no setting: the parameters, and what a torch scheduler adds (its own ``initial_lr``)
_NOT_GROUP_SETTINGS = frozenset({"params", "initial_lr"})


def describe_optimizers(optimizers: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each optimizer's parameter groups' settings as built (``lr``, ``momentum``, ``betas``,
    ``weight_decay``..., plain data only), by optimizer name, in group order: what a stateful resume
    compares (:func:`optimizer_differences`), since loading a LAST's optimizer state puts the run's
    settings back over the trainer's."""
    return {name: [{k: v for k, v in ((k, _plain(v)) for k, v in sorted(g.items()) if k not in _NOT_GROUP_SETTINGS)
                    if v is not _SKIP} for g in opt.param_groups]
            for name, opt in optimizers.items()}


def optimizer_differences(run: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """Where ``given``'s optimizer settings (:func:`describe_optimizers`) differ from the ``run``'s, one line
    each: ``"sgd group 0 lr: 0.1 in the run, 0.5 given"``. Only the optimizers, groups and keys both
    hold are compared (a key a newer torch adds is no difference)."""
    out = []
    for name in sorted(set(run) & set(given)):
        for i, (a, b) in enumerate(zip(run[name], given[name])):
            for key in sorted(set(a) & set(b)):
                x, y = a[key], b[key]
                if x != y or isinstance(x, bool) != isinstance(y, bool):
                    out.append(f"{name} group {i} {key}: {x!r} in the run, {y!r} given")
    return out
