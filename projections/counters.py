"""Counters projection (spec 004 "Training counters"), rebuilt from the log."""

from __future__ import annotations

import msgspec

from events.schema import Counters, EpochBegan, EpochSummarized, Event, MicrobatchDone, UpdateCommitted

__all__ = ["fold_counters"]


def fold_counters(state: Counters, event: Event) -> Counters:
    """Advance the counters. Several receipts of one commit (one per optimizer) share a step."""
    match event:
        case MicrobatchDone():
            return msgspec.structs.replace(state, batch=state.batch + 1, epoch_step=state.epoch_step + 1)
        case UpdateCommitted(step=step, data_parallel_size=dp) if step != state.step:
            return msgspec.structs.replace(state, step=step, global_step=state.global_step + dp)
        case EpochBegan():
            return msgspec.structs.replace(state, epoch_step=0)
        case EpochSummarized(epoch=epoch):
            return msgspec.structs.replace(state, epoch=epoch + 1)
        case _:
            return state
