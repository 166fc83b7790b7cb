"""Counters projection (spec 004 "Training counters"), rebuilt from the log."""

from __future__ import annotations

from events.schema import Counters, EpochBegan, EpochSummarized, Event, MicrobatchDone, UpdateCommitted

__all__ = ["FOLDED","fold_counters"]


def fold_counters(state: Counters, event: Event) -> Counters:
    """Advance the counters. Several receipts of one commit (one per optimizer) share a step."""
    acc = CountersAccumulator(state)
    return acc.freeze() if acc.apply(event) else state


#: The event types fold_counters reacts to; every other event leaves its state unchanged (tested).
FOLDED: tuple[type[Event], ...] = (MicrobatchDone, UpdateCommitted, EpochBegan, EpochSummarized,)


class CountersAccumulator:
    """The counters fold applied in place, for folding long runs of events without a struct per event.

    ``fold_counters`` is this applied to one event; :func:`projections.view.project`
    applies it to every committed event and freezes once.
    """

    __slots__ = ("batch", "step", "global_step", "epoch", "epoch_step")

    def __init__(self, c: Counters) -> None:
        self.batch, self.step, self.global_step = c.batch, c.step, c.global_step
        self.epoch, self.epoch_step = c.epoch, c.epoch_step

    def apply(self, event: Event) -> bool:
        """Fold ``event`` in place; return whether anything changed."""
        t = type(event)
        if t is MicrobatchDone:
            self.batch += 1
            self.epoch_step += 1
        elif t is UpdateCommitted:
            if event.step == self.step:  # type: ignore[attr-defined]
                return False  # another optimizer's receipt of the same commit
            self.step = event.step  # type: ignore[attr-defined]
            self.global_step += event.data_parallel_size  # type: ignore[attr-defined]
        elif t is EpochBegan:
            self.epoch_step = 0
        elif t is EpochSummarized:
            self.epoch = event.epoch + 1  # type: ignore[attr-defined]
        else:
            return False
        return True

    def freeze(self) -> Counters:
        return Counters(batch=self.batch, step=self.step, global_step=self.global_step, epoch=self.epoch,
                        epoch_step=self.epoch_step)
