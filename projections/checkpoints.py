"""Checkpoint pointers projection: which manifest is LAST, BEST and each phase."""

from __future__ import annotations

import msgspec

from events.schema import BestCommitted, CallbackCheckpointed, Event, LastCommitted, PhaseCommitted

__all__ = ["FOLDED","CheckpointsState", "Pointer", "fold_checkpoints"]


class Pointer(msgspec.Struct, frozen=True, kw_only=True):
    """A committed checkpoint: manifest SHA-256 (hex), 0-based epoch, step count."""

    manifest: str
    epoch: int
    step: int = 0
    value: float | None = None


class CheckpointsState(msgspec.Struct, frozen=True, kw_only=True):
    last: Pointer | None = None
    best: Pointer | None = None
    phases: dict[str, Pointer] = {}
    callbacks: dict[str, Pointer] = {}
    commits: int = 0


def fold_checkpoints(state: CheckpointsState, event: Event) -> CheckpointsState:
    match event:
        case LastCommitted(manifest=m, epoch=e, step=s):
            return msgspec.structs.replace(
                state, last=Pointer(manifest=m, epoch=e, step=s), commits=state.commits + 1
            )
        case BestCommitted(manifest=m, epoch=e, value=v):
            step = state.last.step if state.last is not None else 0
            return msgspec.structs.replace(state, best=Pointer(manifest=m, epoch=e, step=step, value=v))
        case PhaseCommitted(name=name, manifest=m, epoch=e, removed=removed):
            phases = {k: v for k, v in state.phases.items() if k not in removed}
            phases[name] = Pointer(manifest=m, epoch=e, step=state.last.step if state.last is not None else 0)
            return msgspec.structs.replace(state, phases=phases)
        case CallbackCheckpointed(name=name, blob=blob, epoch=e):
            return msgspec.structs.replace(
                state, callbacks={**state.callbacks, name: Pointer(manifest=blob, epoch=e)}
            )
        case _:
            return state


#: The event types fold_checkpoints reacts to; every other event leaves its state unchanged (tested).
FOLDED: tuple[type[Event], ...] = (LastCommitted, BestCommitted, PhaseCommitted, CallbackCheckpointed,)
