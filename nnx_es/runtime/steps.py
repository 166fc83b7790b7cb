"""The step recorder: what a microbatch's and an update's results become in the run.

:class:`StepRecorder` drives the update engine for the default step and turns what it returns
into the run's record, in this order (spec 000 "Lifecycle order")::

    microbatch  engine.microbatch -> the epoch's row counts and metric sums (a declared metric
                that cannot score the outputs is refused here, before anything is recorded) ->
                per-row records -> microbatch_done, held (its loss is read with the window); a
                microbatch that fills the window when no hook runs before the window's read is
                recorded after that read instead, with its values (nothing can see it between)
    window end  engine.update -> the microbatch_done released with the window's floats ->
                update_skipped per optimizer, or update_committed per optimizer (the step
                receipts) -> on_optimizer_update -> optimizer_update-clock schedulers step
                (scheduler_stepped) -> AFTER_OPTIMIZER_STEP

It keeps the epoch's totals (:class:`EpochTotals`: the summary's sums and counts) and what the
current batch did (``recorded``, ``update``), which the loop reads. A custom
``trainer_step_fn`` reports its updates through :meth:`StepRecorder.report_update` (the
context's ``report_update``) and its microbatches through :meth:`StepRecorder.record_microbatch`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from events.schema import MicrobatchDone, UpdateCommitted, UpdateSkipped
from nnx_es.errors import ConfigError
from nnx_es.metrics import MetricSums
from nnx_es.objective import batch_rows
from nnx_es.runtime.engine import UpdateResult
from nnx_es.schedulers import step_update_clock
from nnx_es.stages import TrainingStage

if TYPE_CHECKING:
    from torch import Tensor

    from nnx_es.callbacks import CallbackList
    from nnx_es.runtime.recording import Recorder
    from nnx_es.rows.recorder import RowRecorder
    from nnx_es.runtime.context import TrainContext
    from nnx_es.runtime.engine import UpdateEngine
    from nnx_es.schedulers import Scheduler

__all__ = ["EpochTotals", "StepRecorder", "default_train_step", "finalize_step"]


def default_train_step(ctx: TrainContext, batch: Any) -> None:
    """The default ``trainer_step_fn``: one microbatch, and the update when it fills the window."""
    ctx.steps.train(ctx, batch, ctx.batch_index)


def finalize_step(ctx: TrainContext) -> bool:
    """Close the current accumulation window of ``ctx``'s run; True when it committed an update."""
    result = ctx.steps.finalize(ctx)
    return result is not None and result.reason is None


class EpochTotals:
    """Whole-epoch training sums (for the epoch summary) and window counts."""

    __slots__ = ("sums", "microbatches", "updates", "skipped")

    def __init__(self, metrics: tuple[Any, ...] = (), ignore: tuple[int, ...] = ()) -> None:
        self.sums = MetricSums(metrics)
        self.sums.ignore = ignore  # accuracy leaves out what the loss ignores
        self.microbatches = 0
        self.updates = 0
        self.skipped = 0


class StepRecorder:
    """Records one run's microbatches and updates (see the module docstring).

    Args:
        engine: computes them.
        recorder: the run's event recorder.
        callbacks: the run's callbacks (``on_optimizer_update``).
        schedulers: the run's schedulers; those on the ``optimizer_update`` clock step after each
            committed update of their optimizer.
        metrics: the declared metrics summed over each epoch (:mod:`nnx_es.metrics`).
        rows: the per-row records (None: none).
        world_size: the data-parallel size (the receipts of a custom step's updates).
    """

    def __init__(self, engine: UpdateEngine, recorder: Recorder, callbacks: CallbackList,
                 schedulers: Sequence[Scheduler] = (), *, metrics: tuple[Any, ...] = (),
                 rows: RowRecorder | None = None, world_size: int = 1) -> None:
        self.engine = engine
        self.recorder = recorder
        self.callbacks = callbacks
        self.update_clock = [s for s in schedulers if s.clock == "optimizer_update"]
        self.metrics = metrics
        self.rows = rows
        self.world_size = world_size
        self.objective = engine.objective
        self._on_update = callbacks.has("on_optimizer_update")
        #: no hook runs between a microbatch and its window's read: one that fills the window is recorded after it
        orchestrator = engine.orchestrator
        self._direct = not engine.stages.by_stage and (orchestrator is None or not (
            orchestrator.backward_owner or orchestrator.step_owner or orchestrator.can_veto
            or orchestrator.has_after_step))
        self._after_step = engine.stages if engine.stages.has(TrainingStage.AFTER_OPTIMIZER_STEP) else None
        self.epoch = 0
        self.totals = EpochTotals(metrics, engine.objective.ignore)
        #: the current batch: whether its microbatch_done was emitted, the update it closed (or None)
        self.recorded = False
        self.update: UpdateResult | None = None
        self.last_rows = 0  # the latest microbatch's rows
        #: microbatches a custom step recorded since its last reported update
        self.unreported = 0
        #: held microbatch_done events: (seq, epoch, batch, rows, loss on the device), in window order
        self._held: list[tuple[int, int, int, int, Tensor]] = []
        #: the latest microbatch loss read: (its tensor, its mean loss), for the view (TrainContext.loss)
        self.last_loss: tuple[Any, float] | None = None

    # --- the epoch ------------------------------------------------------------------------

    def begin_epoch(self, epoch: int) -> None:
        """Start ``epoch``'s totals (a custom step's unread microbatches belong to the epoch before)."""
        if self._held:
            self.settle()
        self.epoch = epoch
        self.totals = EpochTotals(self.metrics, self.objective.ignore)

    # --- one microbatch -------------------------------------------------------------------

    def train(self, ctx: TrainContext, batch: Any, index: int, *, update: bool = True) -> UpdateResult | None:
        """The default step: microbatch ``index`` of the epoch through the engine, recorded, and its
        window's update when it fills the window (``update=False``: the window stays open for
        :meth:`finalize`, ``engine.window_full`` telling whether it is full)."""
        objective = self.objective
        if objective.scheduled:  # scheduled loss weights: a function of the counters
            objective.at(self.recorder.live.step, self.epoch)
        outputs, targets, weights, parts, loss_t = self.engine.microbatch(batch, ctx)
        totals = self.totals
        sums = totals.sums
        if sums.with_accuracy:  # a declared metric that cannot score them: refused before it is recorded
            sums.check(outputs, targets)
        if self.rows is not None:  # per-row records (nnx_es.rows): formed on the device, read at the epoch's close
            self.rows.add("train", batch, outputs, targets)
        rows = batch_rows(targets)
        if sums.scores_rows:
            sums.add_rows(outputs, targets, weights, rows=rows)
        else:
            sums.rows += rows  # all add_rows does when nothing scores the rows
        totals.microbatches += 1
        ctx.rows = self.last_rows = rows
        self.recorded = True
        engine = self.engine
        full = engine.window.microbatches >= engine.accumulation
        if full and update and self._direct and not self._held:  # its window is read next, before anything sees it
            return self.finalize(ctx, (self.epoch, index, rows, loss_t))  # recorded when read (_release)
        rec = self.recorder
        rec.hold(self.settle)  # its loss is filled in when the window's values are read (one transfer)
        seq = rec.emit(MicrobatchDone(epoch=self.epoch, batch=index, rows=rows, examples=parts.den, loss=math.nan))
        self._held.append((seq, self.epoch, index, rows, loss_t))
        return self.finalize(ctx) if full and update else None

    def settle(self, last: tuple[int, int, int, Tensor] | None = None) -> None:
        """Read the held microbatches' losses now and record them (the recorder asks before it
        writes while events are held: a flush inside a window); ``last``: see :meth:`_release`."""
        self.engine.window.read()
        self._release(last)

    def _release(self, last: tuple[int, int, int, Tensor] | None = None) -> None:
        """Record the held microbatches the window has read, with their floats: the held
        ``microbatch_done`` events released, the epoch's sums (in microbatch order: every float is
        what a read per microbatch gave), the view's loss. ``last``: the window's only microbatch,
        not emitted yet (epoch, batch, rows, loss on the device): emitted now."""
        window = self.engine.window
        reads = window.reads
        if not reads:
            return
        window.reads = []  # taken
        if last is None:
            n = len(reads)
            held = self._held
            self._held = held[n:]
        else:
            n, held = 1, [(-1, *last)]
        sums = self.totals.sums
        nan = math.nan
        final: dict[int, MicrobatchDone] = {}
        loss = nan
        for (seq, epoch, batch, rows, _), (num, den, nums) in zip(held, reads):
            terms: dict[str, float] = {}
            if nums:
                terms = {k: (v / den if den > 0 else nan) for k, v in nums.items()}
                sums.add_loss(num, den, nums)
            else:
                sums.add_loss(num, den)
            loss = num / den if den > 0 else nan
            done = MicrobatchDone(epoch=epoch, batch=batch, rows=rows, examples=den, loss=loss, terms=terms)
            if seq < 0:
                self.recorder.emit(done)
            else:
                final[seq] = done
        self.last_loss = (held[n - 1][-1], loss)  # the view's loss, read (TrainContext.loss)
        if final:
            self.recorder.release(final)

    # --- the window's end -----------------------------------------------------------------

    def finalize(self, ctx: TrainContext, last: tuple[int, int, int, Tensor] | None = None) -> UpdateResult | None:
        """Close the open window (see the module docstring); None when none is open. ``last``: the
        window's only microbatch, recorded after the window's read (see :meth:`_release`)."""
        try:
            result = self.engine.update(ctx)
        finally:  # what the update read is recorded now (and, when it failed before reading, read now)
            if last is not None and not self.engine.window.reads:
                self.settle(last)
            else:
                self._release(last)
        if result is None:
            return None
        self.update = result
        epoch, rec = self.epoch, self.recorder
        if result.reason is not None:
            self.totals.skipped += 1
            for n in result.optimizers:
                rec.emit(UpdateSkipped(step=rec.live.step, epoch=epoch, microbatches=result.microbatches,
                                       reason=result.reason, optimizer=n, detail=result.detail, **result.counts))
            return result
        self._commit(ctx, result.optimizers, loss=result.loss, counts=result.counts,
                     microbatches=result.microbatches, grad_norm=result.grad_norm, clipped=result.clipped,
                     lrs=result.lrs)
        if self._after_step is not None:
            self._after_step(TrainingStage.AFTER_OPTIMIZER_STEP, ctx)
        return result

    def _commit(self, ctx: TrainContext, names: list[str], *, loss: float, counts: dict[str, Any], microbatches: int,
                grad_norm: float | None, clipped: bool, lrs: dict[str, list[float]]) -> None:
        """The receipts of a committed update, ``on_optimizer_update``, the update-clock schedulers."""
        rec = self.recorder
        step = rec.live.step + 1
        objective = self.objective
        weights = objective.weights() if objective.scheduled else {}
        receipts = []
        for n in names:
            receipt = UpdateCommitted(
                step=step, epoch=self.epoch, microbatches=microbatches, loss=loss, grad_norm=grad_norm,
                clipped=clipped, lrs=lrs[n], optimizer=n, precision=self.engine.precision, **counts,
                loss_weights=weights)
            rec.emit(receipt)
            if self._on_update:
                receipts.append(receipt)
        self.totals.updates += 1
        for r in receipts:
            self.callbacks.optimizer_update(ctx, r)
        if self.update_clock:
            step_update_clock(self.update_clock, names, rec, epoch=self.epoch, step=step)

    # --- a custom step --------------------------------------------------------------------

    def report_update(self, ctx: TrainContext, *, loss: float, examples: float, optimizers: list[str],
                      microbatches: int, grad_norm: float | None, clipped: bool) -> None:
        """Receipts for an update a custom step committed (see ``TrainContext.report_update``).

        Raises:
            ConfigError: an optimizer that is not one of the run's.
        """
        known = self.engine.optimizers
        unknown = [n for n in optimizers if n not in known]
        if unknown:
            raise ConfigError(f"report_update names unknown optimizers {unknown}; known: {list(known)}")
        self.record_microbatch(ctx, loss=loss, examples=examples)
        sums = self.totals.sums
        if math.isfinite(loss) and examples > 0:  # the epoch summary holds what the custom step reported
            sums.num += loss * examples
            sums.den += examples
        lrs = {n: [float(g["lr"]) for g in known[n].param_groups] for n in optimizers}
        counts = {
            "local_examples": examples, "global_examples": examples, "data_parallel_size": self.world_size,
            "accumulation_steps": self.engine.accumulation, "collective_bytes": 0,
        }
        self._commit(ctx, optimizers, loss=loss, counts=counts, microbatches=microbatches,
                     grad_norm=grad_norm, clipped=clipped, lrs=lrs)
        self.update = UpdateResult(None, "", optimizers, microbatches, loss, grad_norm, clipped, lrs, counts)

    def record_microbatch(self, ctx: TrainContext, *, loss: float | None, examples: float) -> None:
        """Emit ``microbatch_done`` for the current batch of a custom ``trainer_step_fn``, once
        (the default step emits its own)."""
        if self.recorded:
            return
        self.recorded = True
        self.unreported += 1
        self.totals.microbatches += 1
        batch = ctx.batch
        rows = len(batch[0]) if isinstance(batch, (tuple, list)) and hasattr(batch[0], "__len__") else 1
        self.recorder.emit(MicrobatchDone(
            epoch=self.epoch, batch=ctx.batch_index, rows=rows, examples=float(examples),
            loss=float(loss) if loss is not None else math.nan,
        ))
