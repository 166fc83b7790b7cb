"""Plan projection: what an experiment plan's log says of it (:mod:`events.plans`).

A pure fold over the plan log: its declaration, and each trial's progress -- ``pending`` (no
event yet), ``started`` (``trial_started`` without its end: the trial to resume) or ``ended``
(with the status its ``trial_ended`` copied from the run). What a trial achieved is read from
its run's own log, never from here (:mod:`nnx_es.plan`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from events.plans import PlanFinished, PlanResumed, PlanStarted, TrialEnded, TrialStarted
from events.schema import Event

__all__ = ["FOLDED", "PlanState", "TrialState", "fold_plan", "project_plan"]


class TrialState(msgspec.Struct, frozen=True, kw_only=True):
    """One trial as the plan log tells it. state: ``started`` | ``ended``."""

    index: int
    run_id: str
    state: str
    starts: int = 1
    ended: TrialEnded | None = None


class PlanState(msgspec.Struct, frozen=True, kw_only=True):
    """``started``: the ``plan_started`` (None before it); ``trials``: by index, those with events."""

    started: PlanStarted | None = None
    trials: dict[int, TrialState] = {}
    resumes: int = 0
    finished: bool = False

    @property
    def ended(self) -> int:
        """How many trials have ended."""
        return sum(t.state == "ended" for t in self.trials.values())


def fold_plan(state: PlanState, event: Event) -> PlanState:
    match event:
        case PlanStarted():
            return PlanState(started=event)
        case PlanResumed():
            return msgspec.structs.replace(state, resumes=state.resumes + 1)
        case TrialStarted(index=i, run_id=run_id):
            old = state.trials.get(i)
            trial = TrialState(index=i, run_id=run_id, state="started", starts=(old.starts + 1) if old else 1)
            return msgspec.structs.replace(state, trials={**state.trials, i: trial})
        case TrialEnded(index=i, run_id=run_id):
            old = state.trials.get(i)
            trial = TrialState(index=i, run_id=run_id, state="ended", starts=old.starts if old else 0, ended=event)
            return msgspec.structs.replace(state, trials={**state.trials, i: trial})
        case PlanFinished():
            return msgspec.structs.replace(state, finished=True)
        case _:
            return state


def project_plan(events: Any) -> PlanState:
    """Fold ``events`` (an iterable of plan events, or of ``(seq, event)``) from the empty state."""
    state = PlanState()
    for item in events:
        state = fold_plan(state, item[1] if isinstance(item, tuple) else item)
    return state


#: The event types fold_plan reacts to; every other event leaves its state unchanged.
FOLDED: tuple[type[Event], ...] = (PlanStarted, PlanResumed, TrialStarted, TrialEnded, PlanFinished)
