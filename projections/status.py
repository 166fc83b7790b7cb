"""Status projection: running / completed / stopped / failed / interrupted (Ctrl-C), with the error."""

from __future__ import annotations

import msgspec

from events.schema import Event, RunFailed, RunFinalized, RunResumed, RunStarted, StopRequested

__all__ = ["FOLDED", "StatusState", "UNFINISHED", "fold_status"]

#: the statuses of a run not finalized: its writer is at work, or was killed or crashed before
#: ``run_finalized`` (readers flag the second by its writer lease)
UNFINISHED: frozenset[str] = frozenset({"new", "running", "failing"})


class StatusState(msgspec.Struct, frozen=True, kw_only=True):
    status: str = "new"
    run_id: str = ""
    seed: int | None = None
    resumes: int = 0
    stop_reason: str | None = None
    error: str | None = None
    error_type: str | None = None


def fold_status(state: StatusState, event: Event) -> StatusState:
    match event:
        case RunStarted(run_id=run_id, seed=seed):
            return StatusState(status="running", run_id=run_id, seed=seed)
        case RunResumed():
            return msgspec.structs.replace(
                state, status="running", resumes=state.resumes + 1, stop_reason=None, error=None, error_type=None
            )
        case StopRequested(reason=reason):
            return msgspec.structs.replace(state, stop_reason=reason)
        case RunFailed(error_type=t, message=m):
            return msgspec.structs.replace(state, status="failing", error=m, error_type=t)
        case RunFinalized(status=s):
            return msgspec.structs.replace(state, status=s)
        case _:
            return state


#: The event types fold_status reacts to; every other event leaves its state unchanged (tested).
FOLDED: tuple[type[Event], ...] = (RunStarted, RunResumed, StopRequested, RunFailed, RunFinalized,)
