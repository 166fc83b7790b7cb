"""How one rank's outcome becomes every rank's: a refusal or failure travels as its class and message.

Agreement points 3 and 4 (docs/ARCHITECTURE.md "Seams for data parallelism"): the writer
alone verifies a resume point and makes each commit durable; the other ranks learn the
outcome through one collective and raise the same error (same class, same message) --
never a barrier plus a rank-local flag.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["agree_outcome", "describe_error", "raise_described"]


def describe_error(exc: BaseException) -> dict[str, str]:
    """``exc`` as builtins another rank can raise again: module, class name, message."""
    return {"module": type(exc).__module__, "name": type(exc).__qualname__, "message": str(exc)}


def raise_described(error: dict[str, str], *, by: str = "the writer rank") -> None:
    """Raise the error :func:`describe_error` described: the same class (when it takes a message),
    the same message, saying which rank decided it; a class that cannot be rebuilt: RuntimeError."""
    message = f"{error['message']} (decided by {by})"
    try:
        cls = getattr(importlib.import_module(error["module"]), error["name"])
        exc = cls(message) if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError(message)
    except Exception:  # noqa: BLE001 - the message still travels
        exc = RuntimeError(f"{error['name']}: {message}")
    raise exc


def agree_outcome(world: Any, error: BaseException | None) -> None:
    """Every rank's outcome of the same step: one all-reduce of "did any rank fail", then (only then)
    an all-gather of the failures; the first failure (rank order) is raised on every rank -- this rank's own exception object where it is this rank's. One process:
    ``error`` is raised as it is."""
    if not world.distributed:
        if error is not None:
            raise error
        return
    if not world.agree_flag(error is not None):  # one all-reduce; the descriptions only on a failure
        return
    outcomes = world.gather(None if error is None else describe_error(error))
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            if rank == world.rank and error is not None:
                raise error
            raise_described(outcome, by=f"rank {rank}")
