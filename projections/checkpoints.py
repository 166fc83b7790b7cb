"""Checkpoint pointers projection: which manifest is LAST, BEST and each phase; which checkpoints
are stored (named by a committed LAST and not pruned) and which retention pruned."""

from __future__ import annotations

import msgspec

from events.schema import BestCommitted, CallbackCheckpointed, CheckpointPruned, Event, LastCommitted, PhaseCommitted

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
    #: manifest -> 0-based epoch of every checkpoint a LAST named and retention has not pruned, oldest first
    stored: dict[str, int] = {}
    #: manifest -> the reason retention gave when it pruned the checkpoint
    pruned: dict[str, str] = {}


def fold_checkpoints(state: CheckpointsState, event: Event) -> CheckpointsState:
    match event:
        case LastCommitted(manifest=m, epoch=e, step=s):
            stored = state.stored if m in state.stored else {**state.stored, m: e}
            return msgspec.structs.replace(
                state, last=Pointer(manifest=m, epoch=e, step=s), commits=state.commits + 1, stored=stored
            )
        case CheckpointPruned(manifest=m, reason=reason):
            return msgspec.structs.replace(
                state, stored={k: v for k, v in state.stored.items() if k != m}, pruned={**state.pruned, m: reason}
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
FOLDED: tuple[type[Event], ...] = (LastCommitted, BestCommitted, PhaseCommitted, CallbackCheckpointed,
                                   CheckpointPruned)
