"""What a run declares about its loss, so that a stateful resume can refuse another one.

A stateful resume continues *the same* run: a different loss would make the rest of its history,
BEST and the monitor's decisions compare numbers of another kind, and the run would still end
``completed``. The objective is described by names and settings, never by code: a torch loss
module by its class and its constructor settings (the scalar attributes it keeps, a tensor
setting such as a class ``weight`` by its SHA-256), a function by ``module:qualname``, each with
the term's weight.
"""

from __future__ import annotations

import hashlib
from typing import Any

from torch import nn

__all__ = ["describe_loss", "describe_objective"]

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
