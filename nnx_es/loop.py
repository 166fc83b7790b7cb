"""The training loop of one run: the walk through the lifecycle machine, epoch by epoch.

:class:`TrainingLoop` is built by the trainer for each ``fit`` once the session is open,
with exactly what it drives: the run state, the update engine, the callbacks, the
committer, the stage hooks, the validation pass and finalization. Its order is the one
:mod:`nnx_es.trainer`'s docstring gives as pseudocode (spec 000 "Lifecycle order").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import structlog
import torch
from torch import nn
from torch.optim import Optimizer

from events.schema import (
    CallbackBegan,
    EpochBegan,
    EpochSummarized,
    HistoryAppended,
    HistoryRecord,
    RunResumed,
    RunStarted,
    TrainBegan,
    UpdateSkipped,
    ValidationDone,
)
from nnx_es.callbacks import CallbackList
from nnx_es.commit import Committer
from nnx_es.context import TrainContext
from nnx_es.data import iterate_batches
from nnx_es.engine import UpdateEngine
from nnx_es.errors import ConfigError
from nnx_es.finalize import Finalization
from nnx_es.monitor import Monitor
from nnx_es.progress import Progress
from nnx_es.run_state import RunState
from nnx_es.schedulers import Scheduler, step_epoch_clock
from nnx_es.stages import StageDispatcher, TrainingStage

__all__ = ["Cadence", "TrainingLoop"]

log = structlog.get_logger("nnx_es")

#: one validation pass over a loader: (``val_`` metrics, rows scored)
Validate = Callable[[Iterable[Any]], tuple[dict[str, float], int]]


class Cadence(msgspec.Struct, frozen=True):
    """When to validate: every ``every`` epochs (and after the last), and every ``every_steps``
    committed updates (no monitor decision then)."""

    every: int = 1
    every_steps: int | None = None


class TrainingLoop:
    """Runs the epochs of one session, then finalization.

    Args:
        state: the run (recorder, stop request, step outcome).
        ctx: the context hooks and callbacks receive.
        net / optimizers / schedulers / monitor: what the epoch trains, records and decides with.
        engine: microbatches and updates (the default step drives it).
        callbacks / stages: the run's callbacks and stage hooks.
        committer: each epoch's durable commit.
        finalization: run once training ends, however it ends.
        validate: one validation pass; ``cadence`` says when.
        step_fn / custom_step: the ``trainer_step_fn`` and whether it is the user's.
        batch_gather: see :func:`nnx_es.data.iterate_batches`.
        progress: the progress display.
        device: where each training batch's tensors are moved (``None``: as they come).
    """

    def __init__(self, *, state: RunState, ctx: TrainContext, net: nn.Module, optimizers: dict[str, Optimizer],
                 schedulers: Sequence[Scheduler], monitor: Monitor | None, engine: UpdateEngine,
                 callbacks: CallbackList, stages: StageDispatcher, committer: Committer, finalization: Finalization,
                 validate: Validate, cadence: Cadence, step_fn: Callable[[TrainContext, Any], Any], custom_step: bool,
                 batch_gather: bool, progress: Progress, device: torch.device | None = None) -> None:
        self.state, self.ctx, self.net, self.optimizers = state, ctx, net, optimizers
        self.schedulers, self.monitor, self.engine = schedulers, monitor, engine
        self.callbacks, self.stages, self.committer, self.finalization = callbacks, stages, committer, finalization
        self.validate, self.cadence = validate, cadence
        self.step_fn, self.custom_step, self.batch_gather = step_fn, custom_step, batch_gather
        self.progress, self.device = progress, device

    # --- the run ------------------------------------------------------------------------

    def run(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int,
            opening: RunStarted | RunResumed, start_epoch: int) -> None:
        """Train epochs ``start_epoch .. epochs - 1`` after ``opening``, then finalize.

        Raises:
            Exception: whatever training raised, after finalization (or a cleanup/closing error).
        """
        state, ctx, rec = self.state, self.ctx, self.state.recorder
        t0 = time.time()
        failure: BaseException | None = None
        stopped_at_update = False
        try:
            if isinstance(opening, RunResumed):
                rec.commit(opening)  # the discarded range is durable before anything new is written
            else:
                rec.emit(opening)
            ctx.epoch = start_epoch
            self.callbacks.train_begin(ctx, lambda i, cb: rec.emit(CallbackBegan(name=cb.name, index=i)))
            n_batches = len(train_loader) if hasattr(train_loader, "__len__") else None  # type: ignore[arg-type]
            covers = rec.emit(TrainBegan(start_epoch=start_epoch, epochs=epochs, train_batches=n_batches))
            if isinstance(opening, RunStarted) and self.committer.lag > 0:
                # a new run's opening checkpoint persists while its first epoch trains; its LAST,
                # appended like any deferred LAST, commits the opening events (up to train_began)
                self.committer.submit(epoch=start_epoch - 1, covers=covers, group=False, opening=True)
            else:
                self.committer.commit_now(epoch=start_epoch - 1)
            rec.flush()
            resumed_stopped = state.stop_requested is not None
            if resumed_stopped:  # resumed after the run had decided to stop: finish it
                state.record_stop(epoch=start_epoch - 1, step=ctx.step_count)
            self.stages(TrainingStage.BEFORE_TRAINING, ctx)
            for epoch in range(start_epoch, start_epoch if resumed_stopped else epochs):
                outcome = self._epoch(epoch, train_loader, val_loader, last=epoch == epochs - 1)
                if outcome == "update_boundary":
                    stopped_at_update = True
                    break
                if outcome == "stop":
                    break
            self.stages(TrainingStage.AFTER_TRAINING, ctx)
        except BaseException as exc:  # noqa: BLE001 - re-raised after finalization
            failure = exc
        finally:
            self.progress.close()
        self.finalization.run(failure, stopped_at_update, t0)
        if failure is not None:
            raise failure

    def _stop_at_update(self, epoch: int) -> bool:
        if self.state.stop_at_update_requested:
            self.state.record_stop(epoch=epoch, step=self.ctx.step_count, reason="update_boundary")
            return True
        return False

    def _epoch(self, epoch: int, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, *,
               last: bool) -> str | None:
        state, ctx, engine, committer = self.state, self.ctx, self.engine, self.committer
        rec, outcome = state.recorder, state.outcome
        ctx.epoch, ctx.decision = epoch, None
        t_epoch = time.time()
        rec.emit(EpochBegan(epoch=epoch, wall_time_s=t_epoch))
        engine.begin_epoch()
        self.net.train()
        self.callbacks.epoch_begin(ctx)
        self.stages(TrainingStage.BEFORE_EPOCH, ctx)
        self.progress.start_epoch(epoch, len(train_loader) if hasattr(train_loader, "__len__") else None)  # type: ignore[arg-type]
        step_fn = self.step_fn
        # the per-batch loop: what is absent (stage hooks, batch callbacks, progress, step
        # validation) is decided once per epoch, not per batch
        stages = self.stages if self.stages.by_stage else None
        batch_end = self.callbacks.batch_end if self.callbacks.has("on_batch_end") else None
        progress = self.progress if self.progress.enabled else None
        validate_on_step = val_loader is not None and self.cadence.every_steps is not None
        for i, batch in enumerate(iterate_batches(train_loader, gather=self.batch_gather, device=self.device)):
            ctx.batch_index, ctx.batch = i, batch
            outcome.new_batch()
            if stages:
                stages(TrainingStage.BEFORE_BATCH, ctx)
            out = step_fn(ctx, batch)
            if self.custom_step and not outcome.microbatch_recorded:
                engine.record_microbatch(ctx, loss=float(out) if out is not None else None, examples=0.0)
            if validate_on_step and outcome.committed_update:
                self._maybe_validate_on_step(val_loader)
            if batch_end:
                batch_end(ctx)
            if stages:
                stages(TrainingStage.AFTER_BATCH, ctx)
            if progress:
                # the loss is read at updates only (once per update: no host read inside a window)
                progress.advance(ctx.loss if outcome.committed_update else None, ctx.step_count, ctx.rows)
            if outcome.committed_update:
                outcome.unreported = 0
                if committer.pending is not None:
                    committer.on_update()
                rec.maybe_flush()
                if self._stop_at_update(epoch):
                    return "update_boundary"
        if self.custom_step and rec.lifecycle.base_state == "in_window":
            # the custom step recorded microbatches but reported no update for them: say so
            rec.emit(UpdateSkipped(step=ctx.step_count, epoch=epoch, microbatches=outcome.unreported,
                                   reason="unreported", optimizer=",".join(self.optimizers)))
            outcome.unreported = 0
        if engine.finalize_step(ctx):
            committer.on_update()
            self._maybe_validate_on_step(val_loader)
            if self._stop_at_update(epoch):
                return "update_boundary"
        val: dict[str, float] = {}
        if val_loader is not None and ((epoch + 1) % self.cadence.every == 0 or last):
            val = self._validation_pass(val_loader)
        record = self._close_epoch(epoch, val, t_epoch)
        self.progress.end_epoch(epoch, record)
        log.info("epoch committed", run_id=state.run_id, epoch=epoch, **record.train, **record.val,
                 improved=record.improved)
        return "stop" if state.stop_requested is not None else None

    def _close_epoch(self, epoch: int, val: dict[str, float], t_epoch: float) -> HistoryRecord:
        """Summary, the one monitor decision, epoch-clock schedulers, ``on_epoch_end``, history, commit."""
        state, ctx, rec = self.state, self.ctx, self.state.recorder
        totals = self.engine.epoch
        train = totals.sums.metrics()
        if totals.microbatches == 0:
            log.warning("epoch had no microbatch: the train loader is empty or exhausted", run_id=state.run_id,
                        epoch=epoch)
        elif totals.updates == 0 and not self.custom_step:
            log.warning("epoch committed no optimizer update: every window was skipped", run_id=state.run_id,
                        epoch=epoch, skipped=totals.skipped)
        rec.emit(EpochSummarized(
            epoch=epoch, metrics=train, examples=totals.sums.den, microbatches=totals.microbatches,
            updates=totals.updates, skipped=totals.skipped, duration_s=time.time() - t_epoch,
        ))
        decision = None
        if self.monitor is not None:
            metrics = {**train, **val}
            if self.monitor.name in metrics:
                decision = self.monitor.decide(epoch, float(metrics[self.monitor.name]))
                ctx.decision = decision
                rec.emit(decision)
            elif val or not self.monitor.name.startswith("val_"):
                raise ConfigError(
                    f"monitor {self.monitor.name!r} is not among the epoch's metrics {sorted(metrics)}"
                )
        step_epoch_clock(self.schedulers, decision, rec, epoch=epoch, step=ctx.step_count)
        self.callbacks.epoch_end(ctx)
        self.stages(TrainingStage.AFTER_EPOCH, ctx)
        if state.stop_requested is not None:
            state.record_stop(epoch=epoch, step=ctx.step_count)
        record = HistoryRecord(
            epoch=epoch, train=train, val=val,
            monitor_value=decision.value if decision else None, improved=decision.improved if decision else None,
            lrs={n: [float(g["lr"]) for g in o.param_groups] for n, o in self.optimizers.items()},
            counters=msgspec.structs.replace(rec.counters, epoch=epoch + 1), wall_time_s=time.time() - t_epoch,
        )
        self.committer.complete()  # the previous epoch's LAST precedes this epoch's history
        covers = rec.emit(HistoryAppended(record=record))
        self.committer.submit(epoch=epoch, covers=covers, decision=decision)
        rec.maybe_flush()  # with a lag the history is committed by the next epoch's LAST sync
        return record

    # --- validation -----------------------------------------------------------------------

    def _validation_pass(self, loader: Iterable[Any], trigger: str = "epoch") -> dict[str, float]:
        ctx = self.ctx
        val, n_val = self.validate(loader)
        ctx.validation = val
        self.state.recorder.emit(
            ValidationDone(epoch=ctx.epoch, metrics=val, examples=n_val, step=ctx.step_count, trigger=trigger)
        )
        self.callbacks.validation_end(ctx, val)
        self.stages(TrainingStage.AFTER_VALIDATION, ctx)
        return val

    def _maybe_validate_on_step(self, loader: Iterable[Any] | None) -> None:
        n = self.cadence.every_steps
        if loader is not None and n is not None and self.ctx.step_count % n == 0:
            self._validation_pass(loader, "steps")
