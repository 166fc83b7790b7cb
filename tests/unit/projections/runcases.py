"""Whole runs' event logs, built event by event, for the projection tests."""

from __future__ import annotations

from collections.abc import Sequence

from events import (


    BestCommitted,
    CallbackBegan,
    CheckpointStored,
    Counters,
    EpochBegan,
    EpochSummarized,
    Event,
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    MonitorDecided,
    MonitorSpec,
    RunStarted,
    SchedulerDecl,
    SchedulerStepped,
    TrainBegan,
    UpdateCommitted,
    ValidationDone,
)
from projections import Projections, fold

__all__ = ["fold_all", "half_epoch_tail", "manifest_id", "receipt_at", "RunLog", "SCHEDULERS", "seq_pairs", "two_epochs"]

SCHEDULERS = [
    SchedulerDecl(name="cosine", clock="epoch", cls="CosineAnnealingLR", optimizer="default"),
    SchedulerDecl(name="warmup", clock="optimizer_update", cls="LinearLR", optimizer="default"),
]


def manifest_id(epoch: int, tag: str = "") -> str:
    return f"{tag}{epoch + 1:02d}".ljust(64, "a")


def receipt_at(step: int, epoch: int, optimizer: str = "default", dp: int = 1) -> UpdateCommitted:
    return UpdateCommitted(
        step=step,
        epoch=epoch,
        microbatches=2,
        local_examples=64.0,
        global_examples=64.0 * dp,
        loss=1.0 / step,
        lrs=[0.1 / step],
        optimizer=optimizer,
        data_parallel_size=dp,
    )


class RunLog:
    """Builds a realistic event sequence by hand, tracking step and batch counters."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.step = 0
        self.batch = 0

    def add(self, *events: Event) -> RunLog:
        self.events.extend(events)
        return self

    def counters(self, epochs_done: int, epoch_step: int) -> Counters:
        return Counters(
            batch=self.batch, step=self.step, global_step=self.step, epoch=epochs_done, epoch_step=epoch_step
        )

    def start(self) -> RunLog:
        return self.add(
            RunStarted(
                run_id="run-1",
                seed=7,
                callbacks=["ckpt"],
                optimizers=["default"],
                schedulers=SCHEDULERS,
                monitor=MonitorSpec(name="val_loss"),
            ),
            CallbackBegan(name="ckpt", index=0),
            TrainBegan(start_epoch=0, epochs=4),
            CheckpointStored(manifest=manifest_id(-1), epoch=-1, step=0, components={"model": "b" * 64}),
            LastCommitted(manifest=manifest_id(-1), epoch=-1, step=0, counters=Counters()),
        )

    def epoch_body(self, epoch: int, microbatches: int = 2, loss: float | None = None) -> RunLog:
        """An epoch up to and including its history record (not yet committed)."""
        loss = 1.0 / (epoch + 1) if loss is None else loss
        self.add(EpochBegan(epoch=epoch))
        for i in range(microbatches):
            self.add(MicrobatchDone(epoch=epoch, batch=i, rows=32, examples=32.0, loss=loss))
            self.batch += 1
        self.step += 1
        self.add(
            receipt_at(self.step, epoch),
            ValidationDone(epoch=epoch, metrics={"val_loss": loss}, examples=100, step=self.step),
            EpochSummarized(epoch=epoch, metrics={"loss": loss}, examples=64.0, microbatches=microbatches, updates=1),
            MonitorDecided(
                epoch=epoch,
                monitor="val_loss",
                mode="min",
                value=loss,
                improved=True,
                best=loss,
                best_epoch=epoch,
                bad_epochs=0,
            ),
            SchedulerStepped(name="cosine", clock="epoch", epoch=epoch, step=self.step, steps=epoch + 1, lrs=[loss]),
            HistoryAppended(
                record=HistoryRecord(
                    epoch=epoch,
                    train={"loss": loss},
                    val={"val_loss": loss},
                    monitor_value=loss,
                    improved=True,
                    lrs={"default": [loss]},
                    counters=self.counters(epoch + 1, microbatches),
                )
            ),
        )
        return self

    def commit_epoch(self, epoch: int, microbatches: int = 2, best: bool = True) -> RunLog:
        self.add(
            CheckpointStored(manifest=manifest_id(epoch), epoch=epoch, step=self.step, components={"model": "c" * 64}),
            LastCommitted(
                manifest=manifest_id(epoch), epoch=epoch, step=self.step, counters=self.counters(epoch + 1, microbatches)
            ),
        )
        if best:
            self.add(BestCommitted(manifest=manifest_id(epoch), epoch=epoch, monitor="val_loss", value=0.5))
        return self

    def epoch(self, epoch: int, microbatches: int = 2, best: bool = True) -> RunLog:
        return self.epoch_body(epoch, microbatches).commit_epoch(epoch, microbatches, best)


def seq_pairs(events: Sequence[Event]) -> list[tuple[int, Event]]:
    return list(enumerate(events))


def fold_all(events: Sequence[Event]) -> Projections:
    """Fold every event, committed or not (what a naive reader would do)."""
    state = Projections()
    for seq, event in enumerate(events):
        state = fold(state, seq, event)
    return state


def two_epochs() -> RunLog:
    return RunLog().start().epoch(0).epoch(1)


def half_epoch_tail(run: RunLog, epoch: int) -> list[Event]:
    """An uncommitted tail: a whole epoch body, history included, without its LAST."""
    before = len(run.events)
    run.epoch_body(epoch, loss=0.01)
    run.add(CheckpointStored(manifest=manifest_id(epoch), epoch=epoch, step=run.step, components={"model": "d" * 64}))
    return run.events[before:]
