"""Scheduler projection: per scheduler, its clock, steps taken, learning rates, plateau state."""

from __future__ import annotations

import msgspec

from events.schema import Event, PlateauState, RunStarted, SchedulerStepped

__all__ = ["FOLDED","SchedulerState", "SchedulersState", "fold_schedulers"]


class SchedulerState(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    clock: str
    steps: int = 0
    lrs: list[float] = []
    plateau: PlateauState | None = None
    last_epoch: int = -1
    last_step: int = 0


class SchedulersState(msgspec.Struct, frozen=True, kw_only=True):
    by_name: dict[str, SchedulerState] = {}


def fold_schedulers(state: SchedulersState, event: Event) -> SchedulersState:
    match event:
        case RunStarted(schedulers=decls) if not state.by_name:
            return SchedulersState(by_name={d.name: SchedulerState(name=d.name, clock=d.clock) for d in decls})
        case SchedulerStepped(name=name, clock=clock, steps=steps, lrs=lrs, plateau=plateau, epoch=e, step=s):
            entry = SchedulerState(
                name=name, clock=clock, steps=steps, lrs=lrs, plateau=plateau, last_epoch=e, last_step=s
            )
            return SchedulersState(by_name={**state.by_name, name: entry})
        case _:
            return state


#: The event types fold_schedulers reacts to; every other event leaves its state unchanged (tested).
FOLDED: tuple[type[Event], ...] = (RunStarted, SchedulerStepped,)
