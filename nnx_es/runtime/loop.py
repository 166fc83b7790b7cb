"""The training loop of one run: the walk through the lifecycle machine, epoch by epoch.

:class:`TrainingLoop` is built by the run's scope (:class:`nnx_es.runtime.scope.RunScope`) for
each ``fit`` once the session is open; it drives what the scope built: the step recorder (the
microbatches and updates), the callbacks, the stage hooks, the committer, the validation pass
and finalization. Its order is the one :mod:`nnx_es.trainer`'s docstring gives as pseudocode
(spec 000 "Lifecycle order"). It shows the run to the hooks' view (``ctx``: the epoch, the
batch, the validation metrics, the decision, the summary) and reads nothing back from it.

The loop, as pseudocode (every arrow is an event in ``runs/<id>/events.lmdb``)::

    -> run_started
    for each callback (list order): on_train_begin -> callback_began
    -> train_began ; checkpoint -> checkpoint_stored -> last_committed (initial, synced)
    for epoch in range(start_epoch, epochs):
        -> epoch_began ; on_epoch_begin
        for batch in train_loader:
            trainer_step_fn(ctx, batch)            # default: microbatch -> microbatch_done,
                                                   # window end -> update_committed | update_skipped,
                                                   #   on_optimizer_update, optimizer_update-clock schedulers
            on_batch_end
            stop_at_update requested and an update committed -> stop_requested; finalize (no LAST refresh)
        close a trailing partial window
        validation (every ``validate_every`` epochs) -> validation_done ; on_validation_end
        -> epoch_summarized ; one monitor decision -> monitor_decided
        epoch-clock schedulers (a plateau one on the decision) -> scheduler_stepped
        on_epoch_end (EarlyStopping may request a stop -> stop_requested)
        -> history_appended ; checkpoint -> checkpoint_stored -> last_committed
        -> best_committed (decision improved) -> phase_committed (cadence) -> callback_checkpointed
        (LAST and this group are synced in one write)
    finalization: on_train_end in reverse order -> callback_finalized each
        -> checkpoint_stored -> last_committed(final) -> run_finalized
    on failure: run_failed -> on_train_end of every begun callback -> run_finalized(failed); re-raise
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
import torch

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
from nnx_es.argchecks import NONFINITE
from nnx_es.data import iterate_batches
from nnx_es.errors import ConfigError, NonFiniteError, NonFiniteWarning
from nnx_es.loaders import length_of
from nnx_es.schedulers import step_epoch_clock
from nnx_es.stages import TrainingStage

__all__ = ["Cadence", "LoopSettings", "TrainingLoop"]


log = structlog.get_logger("nnx_es")

#: one validation pass over a loader: (``val_`` metrics, rows scored)
Validate = Callable[[Iterable[Any]], tuple[dict[str, float], int]]


class Cadence(msgspec.Struct, frozen=True):
    """When to validate: every ``every`` epochs (and after the last), and every ``every_steps``
    committed updates (no monitor decision then)."""

    every: int = 1
    every_steps: int | None = None


@dataclass(frozen=True)
class LoopSettings:
    """How the loop walks a run (the Trainer's arguments of the same names).

    Args:
        cadence: when to validate.
        step_fn / custom_step: the ``trainer_step_fn`` and whether it is the user's.
        batch_gather: see :func:`nnx_es.data.iterate_batches`.
        nonfinite: ``"skip"`` an update whose loss or gradient is not finite (warning each epoch
            with the count), ``"stop"`` the run at the first one (the epoch ends there, is
            committed, and the run stops with reason ``nonfinite``), or ``"raise"``
            :class:`~nnx_es.errors.NonFiniteError` (the run fails; LAST stays at the last
            committed epoch). A non-finite validation metric is warned about, stops or raises alike.
        device: where each training batch's tensors are moved (``None``: as they come).
        final_validation: a validation pass once training ends (after ``AFTER_TRAINING``, before
            finalization; ``validation_done(trigger="final")``, then ``on_validation_end`` and
            ``AFTER_VALIDATION``; no monitor decision): ``True`` always with a validation loader,
            ``"auto"`` when the final weights were not the ones last validated, ``False`` never
            (spec 004 "Validation": a final pass when validation is configured).
    """

    cadence: Cadence = Cadence()
    step_fn: Callable[[Any, Any], Any] | None = None
    custom_step: bool = False
    batch_gather: bool = True
    nonfinite: str = "skip"
    device: torch.device | None = None
    final_validation: bool | str = "auto"


class TrainingLoop:
    """Runs the epochs of one session, then finalization.

    Args:
        scope: the run (:class:`~nnx_es.runtime.scope.RunScope`): its state, step recorder,
            context, callbacks, stage hooks, committer, finalization, per-row records (closed
            with the epoch, before ``on_epoch_end``; handed to the run at its history step, before
            ``history_appended``), parameter digests, monitor, schedulers, validation pass and
            progress display.
        settings: how to walk it (:class:`LoopSettings`).
    """

    def __init__(self, scope: Any, settings: LoopSettings) -> None:
        self.state, self.ctx, self.steps = scope.state, scope.ctx, scope.steps
        self.net, self.optimizers = scope.steps.engine.net, scope.steps.engine.optimizers
        self.schedulers, self.monitor = scope.schedulers, scope.monitor
        self.callbacks, self.stages = scope.callbacks, scope.stages
        self.committer, self.finalization = scope.committer, scope.finalization
        self.validate, self.progress = scope.validate, scope.progress
        #: data parallelism: the ranks' parameter digests (:class:`nnx_es.distributed.digest.ParamDigest`)
        self.digest = scope.digest
        self.rows = scope.rows
        self.cadence, self.custom_step = settings.cadence, settings.custom_step
        self.batch_gather = settings.batch_gather
        self.step_fn, self.device, self.nonfinite = settings.step_fn, settings.device, settings.nonfinite
        self.final_validation = settings.final_validation
        self._validated_at = 0  # the step count of the latest validation pass
        self._nonfinite_skips = 0  # this epoch's
        self._epochs = 0
        self.epoch = 0  # the epoch being trained (finalization records a failure in it)

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
            for event in state.after_opening:  # world_changed (nnx_es.distributed.resize), model_transformed (transforms)
                rec.emit(event)
            ctx.epoch = self.epoch = start_epoch
            self._epochs = epochs
            self._validated_at = rec.live.step
            self.callbacks.train_begin(ctx, lambda i, cb: rec.emit(CallbackBegan(name=cb.name, index=i)))
            n_batches = length_of(train_loader)
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
                state.record_stop(epoch=start_epoch - 1, step=rec.live.step)
            self.stages(TrainingStage.BEFORE_TRAINING, ctx)
            last_epoch = start_epoch - 1
            for epoch in range(start_epoch, start_epoch if resumed_stopped else epochs):
                last_epoch = epoch
                outcome = self._epoch(epoch, train_loader, val_loader, last=epoch == epochs - 1)
                if outcome == "update_boundary":
                    stopped_at_update = True
                    break
                if outcome == "stop":
                    break
            if self.digest is not None and self.digest.due_at_end(rec.live.step):
                # the replicas compared at the final step when the cadence's last comparison was not of it
                # (digest_every beyond the run, a stop at an update boundary): after the run's last commit
                self.committer.complete()
                self.digest.check(rec, epoch=max(last_epoch, 0), step=rec.live.step, final=True)
            self.stages(TrainingStage.AFTER_TRAINING, ctx)
            if val_loader is not None and self._final_validation_due():
                self.committer.complete()  # a deferred LAST lands first: the pass follows the run's last commit
                self._validation_pass(val_loader, "final")
        except BaseException as exc:  # noqa: BLE001 - re-raised after finalization
            failure = exc
        finally:
            self.progress.close()
        self.finalization.run(failure, stopped_at_update, t0, epoch=self.epoch)
        if failure is not None:
            raise failure

    def _stop_at_update(self, epoch: int) -> bool:
        if self.state.stop_at_update_requested:
            self.state.record_stop(epoch=epoch, step=self.state.recorder.live.step, reason="update_boundary")
            return True
        return False

    def _epoch(self, epoch: int, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, *,
               last: bool) -> str | None:
        state, ctx, steps, committer = self.state, self.ctx, self.steps, self.committer
        rec = state.recorder
        live = rec.live
        ctx.epoch, ctx.decision = epoch, None
        self.epoch = epoch
        t_epoch = time.time()
        rec.emit(EpochBegan(epoch=epoch, wall_time_s=t_epoch))
        steps.begin_epoch(epoch)
        self.net.train()
        self.callbacks.epoch_begin(ctx)
        self.stages(TrainingStage.BEFORE_EPOCH, ctx)
        progress = self.progress if self.progress.enabled else None
        if progress:  # the loader's length only for a display that shows it
            progress.start_epoch(epoch, length_of(train_loader), epochs=self._epochs)
        set_epoch = getattr(getattr(train_loader, "sampler", None), "set_epoch", None)
        if set_epoch is not None:  # a partition (nnx_es.distributed.train_loader, DistributedSampler) deals this epoch
            set_epoch(epoch)
        self._nonfinite_skips = 0
        step_fn = self.step_fn
        train = None if self.custom_step else steps.train  # the default step
        # the per-batch loop: what is absent (stage hooks, batch callbacks, progress, step
        # validation) is decided once per epoch, not per batch
        stages = self.stages if self.stages.by_stage else None
        batch_end = self.callbacks.batch_end if self.callbacks.has("on_batch_end") else None
        validate_on_step = val_loader is not None and self.cadence.every_steps is not None
        # parameter digests every K updates (DDP(digest_every=K)); at the epoch's end only: none per update
        digest_each = self.digest if self.digest is not None and self.digest.every is not None else None
        for i, batch in enumerate(iterate_batches(train_loader, gather=self.batch_gather, device=self.device)):
            ctx.batch_index, ctx.batch = i, batch
            if stages:
                stages(TrainingStage.BEFORE_BATCH, ctx)
            if train is not None:
                update = train(ctx, batch, i)
            else:
                steps.recorded, steps.update = False, None
                out = step_fn(ctx, batch)  # type: ignore[misc]
                if not steps.recorded:
                    steps.record_microbatch(ctx, loss=float(out) if out is not None else None, examples=0.0)
                update = steps.update
            committed = update is not None and update.reason is None
            if validate_on_step and committed:
                self._maybe_validate_on_step(val_loader)
            if batch_end:
                batch_end(ctx)
            if stages:
                stages(TrainingStage.AFTER_BATCH, ctx)
            if progress:
                # the loss shown is the update's (no host read inside a window)
                loss = update.loss if committed else None  # type: ignore[union-attr]
                progress.advance(loss, live.step, steps.last_rows)
            if update is None:
                continue
            if update.reason == "nonfinite" and self._nonfinite_update(epoch, i):
                break
            if committed:
                steps.unreported = 0
                if digest_each is not None:
                    digest_each.after_update(rec, epoch=epoch, step=live.step)
                if committer.pending is not None:
                    committer.on_update()
                rec.maybe_flush()
                if state.stop_at_update_requested and self._stop_at_update(epoch):
                    return "update_boundary"
        if self.custom_step and rec.lifecycle.base_state == "in_window":
            # the custom step recorded microbatches but reported no update for them: say so
            rec.emit(UpdateSkipped(step=live.step, epoch=epoch, microbatches=steps.unreported,
                                   reason="unreported", optimizer=",".join(self.optimizers),
                                   data_parallel_size=state.world.size))
            steps.unreported = 0
        update = steps.finalize(ctx)  # the epoch's trailing window: an update like those above
        if update is not None and update.reason is None:
            if digest_each is not None:
                digest_each.after_update(rec, epoch=epoch, step=live.step)
            committer.on_update()
            self._maybe_validate_on_step(val_loader)
            if self._stop_at_update(epoch):
                return "update_boundary"
        if update is not None and update.reason == "nonfinite":
            self._nonfinite_update(epoch, ctx.batch_index)
        validating = val_loader is not None and ((epoch + 1) % self.cadence.every == 0 or last)
        deferred = None
        if self.digest is not None:  # after the epoch's last update, before validation
            # without a validation pass nothing is recorded before the epoch's sums are agreed: the
            # digests' comparison rides in that all-reduce (one collective fewer an epoch)
            deferred = self.digest.at_epoch_end(rec, epoch=epoch, step=live.step, defer=not validating)
        val: dict[str, float] = {}
        if validating:
            assert val_loader is not None
            val = self._validation_pass(val_loader)
        record = self._close_epoch(epoch, val, t_epoch, digest_values=deferred)
        self.progress.end_epoch(epoch, record)
        log.info("epoch committed", run_id=state.run_id, epoch=epoch, **record.train, **record.val,
                 improved=record.improved)
        return "stop" if state.stop_requested is not None else None

    def _nonfinite_update(self, epoch: int, batch: int) -> bool:
        """Apply the ``nonfinite`` policy to an update just skipped as non-finite; True: stop the epoch here.

        Raises:
            NonFiniteError: with ``nonfinite="raise"``.
        """
        self._nonfinite_skips += 1
        where = f"epoch {epoch}, batch {batch}, after {self.state.recorder.live.step} committed updates"
        if self.nonfinite == "raise":
            raise NonFiniteError(f"a loss or gradient was not finite at {where}: the update was skipped and "
                                 "nonfinite='raise' ends the run (LAST stays at the last committed epoch); check "
                                 "the inputs and the learning rate, or pass nonfinite='skip' to go on")
        if self.nonfinite == "stop":
            self.state.request_stop("nonfinite", f"nonfinite at {where}")
            return True
        return False

    def _nonfinite_metrics(self, epoch: int, val: dict[str, float]) -> None:
        """Warn about, stop at or raise on the epoch's skipped updates and non-finite validation metrics."""
        bad = sorted(k for k, v in val.items() if not math.isfinite(v))
        if bad:
            what = f"epoch {epoch}: validation metrics {bad} are not finite ({', '.join(f'{k}={val[k]}' for k in bad)})"
            if self.nonfinite == "raise":
                raise NonFiniteError(f"{what}; nonfinite='raise' ends the run: check the validation inputs "
                                     "(NaN or inf features?) or pass nonfinite='skip'")
            if self.nonfinite == "stop":
                self.state.request_stop("nonfinite", what)
            else:
                warnings.warn(f"{what}; the monitor cannot improve on them (nonfinite='skip')", NonFiniteWarning,
                              stacklevel=2)
                log.warning("validation metrics not finite", run_id=self.state.run_id, epoch=epoch, metrics=bad)
        if self._nonfinite_skips and self.nonfinite == "skip":
            n, total = self._nonfinite_skips, self.steps.totals.updates + self.steps.totals.skipped
            warnings.warn(f"epoch {epoch}: {n} of {total} updates were skipped because a loss or gradient was not "
                          "finite (nonfinite='skip'; pass 'stop' or 'raise' to end the run instead)",
                          NonFiniteWarning, stacklevel=2)
            log.warning("updates skipped: not finite", run_id=self.state.run_id, epoch=epoch, skipped=n)

    def _close_epoch(self, epoch: int, val: dict[str, float], t_epoch: float,
                     digest_values: list[float] | None = None) -> HistoryRecord:
        """Summary, the one monitor decision, epoch-clock schedulers, ``on_epoch_end``, history, commit.

        ``digest_values``: the parameter digest's comparison deferred into the sums' all-reduce
        (:meth:`nnx_es.distributed.digest.ParamDigest.at_epoch_end`), settled right after it."""
        state, ctx, rec = self.state, self.ctx, self.state.recorder
        totals = self.steps.totals
        # the union's sums on every rank (and the digests' comparison, when deferred, and whether any rank
        # recorded per-row records: the same all-reduce)
        rows_flag = [float(self.rows.pending)] if self.rows is not None and state.world.distributed else []
        agreed = totals.sums.agree(state.world, self.steps.objective.terms, [*(digest_values or ()), *rows_flag])
        digest_sums = agreed[:len(agreed) - len(rows_flag)]
        if digest_values is not None:
            assert self.digest is not None
            self.digest.settle(rec, digest_sums)  # records params_digested; a difference stops every rank
        train = totals.sums.metrics()
        if totals.microbatches == 0:
            raise ConfigError(f"the train loader yielded no batch in epoch {epoch}: it is empty or exhausted (an "
                              "iterator is used up after one epoch: pass a DataLoader or another re-iterable)")
        if totals.updates == 0 and not self.custom_step:
            log.warning("epoch committed no optimizer update: every window was skipped", run_id=state.run_id,
                        epoch=epoch, skipped=totals.skipped)
        if self.rows is not None:
            # ctx.idps holds the epoch from here on (under DDP every rank's records, gathered)
            self.rows.close_epoch(epoch, gather=bool(rows_flag) and agreed[-1] > 0)
        summary = EpochSummarized(
            epoch=epoch, metrics=train, examples=totals.sums.den, microbatches=totals.microbatches,
            updates=totals.updates, skipped=totals.skipped, duration_s=time.time() - t_epoch,
        )
        rec.emit(summary)
        ctx.epoch_summary, ctx.train_metrics = summary, train
        self._nonfinite_metrics(epoch, val)
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
        step_epoch_clock(self.schedulers, decision, rec, epoch=epoch, step=rec.live.step)
        self.callbacks.epoch_end(ctx)
        self.stages(TrainingStage.AFTER_EPOCH, ctx)
        state.agree_stop()  # a stop one rank asked for (from a rank-local quantity too) stops them all
        if state.stop_requested is not None:
            state.record_stop(epoch=epoch, step=rec.live.step)
        record = HistoryRecord(
            epoch=epoch, train=train, val=val,
            monitor_value=decision.value if decision else None, improved=decision.improved if decision else None,
            lrs={n: [float(g["lr"]) for g in o.param_groups] for n, o in self.optimizers.items()},
            counters=msgspec.structs.replace(rec.counters, epoch=epoch + 1), wall_time_s=time.time() - t_epoch,
        )
        self.committer.complete()  # the previous epoch's LAST precedes this epoch's history
        if self.rows is not None:  # the epoch's per-row records: part of its history step, before LAST
            self.rows.history_step(epoch, rec)
        covers = rec.emit(HistoryAppended(record=record))
        self.committer.submit(epoch=epoch, covers=covers, decision=decision)
        rec.maybe_flush()  # with a lag the history is committed by the next epoch's LAST sync
        return record

    # --- validation -----------------------------------------------------------------------

    def _final_validation_due(self) -> bool:
        """``final_validation``: True always; ``"auto"`` when an update was committed after the last
        pass (the run stopped at an update boundary, or its last pass was a step-cadence one before
        more updates): the final weights are then scored once more; False never."""
        if self.final_validation == "auto":
            return self.state.recorder.live.step != self._validated_at
        return bool(self.final_validation)

    def _validation_pass(self, loader: Iterable[Any], trigger: str = "epoch") -> dict[str, float]:
        ctx = self.ctx
        rows = self.rows
        if rows is not None:
            rows.validating = trigger == "epoch"  # the epoch's validation scores each row once per epoch
        try:
            val, n_val = self.validate(loader)
        finally:
            if rows is not None:
                rows.validating = False
        rec = self.state.recorder
        self._validated_at = rec.live.step
        ctx.validation = val
        rec.emit(ValidationDone(epoch=self.epoch, metrics=val, examples=n_val, step=rec.live.step, trigger=trigger))
        self.callbacks.validation_end(ctx, val)
        self.stages(TrainingStage.AFTER_VALIDATION, ctx)
        return val

    def _maybe_validate_on_step(self, loader: Iterable[Any] | None) -> None:
        n = self.cadence.every_steps
        if loader is not None and n is not None and self.state.recorder.live.step % n == 0:
            self._validation_pass(loader, "steps")
