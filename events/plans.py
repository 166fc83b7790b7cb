"""The vocabulary of an experiment plan's own log (``RUNS_ROOT/plans/<name>/events.lmdb``).

An :class:`nnx_es.ExperimentPlan` trains each of its trials as a run of its own under one runs
root; beside them it keeps a small log of what it did, in the same LMDB log a run uses
(:class:`events.log.LmdbLog`: contiguous keys, a CRC-32 per write, synced commits), with these
events instead of a run's::

    plan_started(declaration) -> ( trial_started -> trial_ended )* -> plan_finished
    a restart:  plan_resumed -> the trials not ended yet ...

The log records the plan's declaration and the order of events; what a trial *achieved* (its
status, its BEST) is read back from the trial's own run log, the source of truth: the copy in
``trial_ended`` is there to be cross-checked, never to rank by.

Conventions are those of :mod:`events.schema` (frozen, ``kw_only``, tag field ``kind``, ``index``
0-based, units in names). These kinds are decoded by :func:`decode_plan_event` only: a run's
decoder refuses them, and this one refuses a run's events.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

import msgspec

from events.errors import CorruptEventError
from events.schema import Event

__all__ = ["PLAN_TYPES", "AnyPlanEvent", "PlanFinished", "PlanResumed", "PlanStarted", "TrialEnded", "TrialStarted",
           "decode_plan_event"]


class PlanStarted(Event, frozen=True, kw_only=True, tag="plan_started"):
    """A plan began. ``declaration``: the plan as declared (its base spec and each trial's overrides and
    seed, JSON); ``declaration_hash``: SHA-256 of its canonical JSON (:func:`events.specs.canonical_hash`):
    a restart under the same name with another declaration is refused. ``trials``: how many."""

    KIND: ClassVar[str] = "plan_started"
    name: str
    declaration: dict[str, Any]
    declaration_hash: str
    trials: int
    library_versions: dict[str, str] = {}
    wall_time_s: float = 0.0


class PlanResumed(Event, frozen=True, kw_only=True, tag="plan_resumed"):
    """The same plan started again (after a kill, or to finish it): ``ended`` trials had ended already."""

    KIND: ClassVar[str] = "plan_resumed"
    ended: int
    wall_time_s: float = 0.0


class TrialStarted(Event, frozen=True, kw_only=True, tag="trial_started"):
    """Trial ``index`` (0-based) began or went on: its run ``run_id`` (under the plan's runs root),
    its ``overrides`` (dotted spec path -> value) and ``seed``. ``resumed``: its run existed already
    (started before a kill): it continues from its LAST."""

    KIND: ClassVar[str] = "trial_started"
    index: int
    run_id: str
    overrides: dict[str, Any]
    seed: int
    resumed: bool = False
    wall_time_s: float = 0.0


class TrialEnded(Event, frozen=True, kw_only=True, tag="trial_ended"):
    """Trial ``index`` ended. ``status``: its run's (``completed`` / ``stopped`` / ``failed``), or
    ``refused`` (no run trained: the error names why); ``stop_reason`` when stopped. ``monitor`` /
    ``best`` / ``best_epoch``: the run's monitor and its BEST (None without one); ``epochs``:
    committed epochs. A copy of what the run's log says, for cross-checking."""

    KIND: ClassVar[str] = "trial_ended"
    index: int
    run_id: str
    status: str
    stop_reason: str | None = None
    monitor: str | None = None
    best: float | None = None
    best_epoch: int | None = None
    epochs: int = 0
    error: str | None = None
    wall_time_s: float = 0.0


class PlanFinished(Event, frozen=True, kw_only=True, tag="plan_finished"):
    """Every trial ended: how many with each status (``status -> count``)."""

    KIND: ClassVar[str] = "plan_finished"
    statuses: dict[str, int]
    wall_time_s: float = 0.0


#: the plan log's event types, in lifecycle order
PLAN_TYPES: tuple[type[Event], ...] = (PlanStarted, PlanResumed, TrialStarted, TrialEnded, PlanFinished)
AnyPlanEvent = Union[PLAN_TYPES]  # type: ignore[valid-type]
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(AnyPlanEvent)


def decode_plan_event(payload: bytes | memoryview, seq: int | None = None) -> Event:
    """Decode one stored value of a plan log.

    Raises:
        CorruptEventError: not msgpack, an unknown kind (a run's event included), or a field missing
            or of the wrong type; naming ``seq``.
    """
    try:
        return _decoder.decode(payload)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptEventError(seq, str(exc)) from None
    except Exception as exc:  # msgspec raises a few others on hostile input
        raise CorruptEventError(seq, f"{type(exc).__name__}: {exc}") from None
