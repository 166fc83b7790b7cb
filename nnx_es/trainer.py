"""The Trainer: the training loop as a walk through the lifecycle machine.

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

Semantics follow spec 000 ("Lifecycle order", durable commit order, failure
semantics) and spec 004 (counters, stages).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
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
    MicrobatchDone,
    RunResumed,
    RunStarted,
    SchedulerStepped,
    StopRequested,
    TrainBegan,
    UpdateSkipped,
    ValidationDone,
)
from nnx_es.callbacks import Callback, LambdaCallback
from nnx_es.commit import Committer
from nnx_es.context import TrainContext
from nnx_es.data import iterate_batches
from nnx_es.engine import UpdateEngine, default_forward, default_train_step
from nnx_es.errors import ConfigError
from nnx_es.finalize import finalization_may_change_state, finalize
from nnx_es.logs import ensure_logging
from nnx_es.monitor import Monitor, step_plateau
from nnx_es.metrics import evaluate, validate_metrics
from nnx_es.objective import Objective
from nnx_es.progress import Progress
from nnx_es.recorder import Recorder
from nnx_es.session import open_session
from nnx_es.validation import check_cadences, check_run_args
from nnx_es.result import RunResult, load_result, result_of
from nnx_es.rng import LoaderGenerators
from nnx_es.schedulers import Scheduler
from projections.view import Projections
from nnx_es.stages import TrainingStage
from nnx_es.update_hooks import GradientAccumulation, GradientClipping, MixedPrecision, collect
from nnx_es.storage import validate_run_id

__all__ = ["Trainer"]

log = structlog.get_logger("nnx_es")



class Trainer:
    """Trains ``net`` and records every lifecycle transition in the run's event log.

    Args:
        net: the model (``nn.Module``); checkpoints hold its ``state_dict``.
        optimizer: one optimizer, or ``{name: optimizer}`` for several (they step together).
        loss: the objective: a loss module/callable returning per-row losses (a
            ``torch.nn`` loss is used with ``reduction="none"``), ``{name: fn or
            (fn, weight)}``, or an :class:`~nnx_es.objective.Objective`.
        monitor: :class:`~nnx_es.monitor.Monitor` or a metric name (``"val_loss"``;
            mode ``max`` when the name contains ``acc``). One decision per
            validated epoch drives BEST, ReduceLROnPlateau and EarlyStopping.
        metrics: declared metrics besides the loss, reported per epoch for training and
            validation (``"accuracy"``: argmax of ``(B, C)`` outputs against ``(B,)`` class ids).
        schedulers: torch schedulers (epoch clock) or :class:`~nnx_es.schedulers.Scheduler`.
        callbacks: :class:`~nnx_es.callbacks.Callback` objects, dispatched in list order.
        hooks: stage hooks (``stage``, ``frequency``, ``__call__(ctx, stage)``, see
            :mod:`nnx_es.stages`) and update hooks (:mod:`nnx_es.update_hooks`).
        accumulation: microbatches per optimizer update (shortcut for ``GradientAccumulation``).
        clip_grad_norm: max total gradient L2 norm (shortcut for ``GradientClipping``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (shortcut for ``MixedPrecision``).
        track_grad_norm: record every update's total gradient L2 norm (before clipping) in
            ``update_committed.grad_norm``; clipping always records it. Default off: ``None``.
        train_step_fn / eval_step_fn: ``fn(net, batch) -> (outputs, targets, weights|None)``.
        trainer_step_fn: ``fn(ctx, batch)`` replacing the whole microbatch+update
            path; it reports its updates with ``ctx.report_update(...)``.
        validate_every: validate every N epochs (and after the last epoch).
        validate_every_steps: also validate every N committed updates (no monitor decision).
        phase_every / keep_phases: a phase checkpoint every N epochs; keep the newest K.
        checkpoint_lag: 0 commits each epoch's LAST at its end; N > 0 persists the
            checkpoint on a background thread and appends LAST after N committed
            updates of the next epoch; ``"epoch"``: at the next epoch's end (see
            :mod:`nnx_es.commit`). A crash can then lose up to that much more work.
        runs_root: the directory holding ``<run_id>/`` and ``.leases/``.
        run_id: ``[A-Za-z0-9._-]{1,128}``; default: a timestamp and random suffix.
        seed: seeds Python, numpy and torch before training.
        progress: show a progress display (default: when stderr is a terminal).
        batch_gather: fetch each batch of a ``DataLoader`` over an in-memory ``TensorDataset``
            with one index per tensor instead of row by row -- the same batches, order and RNG
            draws (see :mod:`nnx_es.data`); ``False`` iterates every loader as given.
        recipe: your run's configuration as JSON-like builtins (data set, hyperparameters, code
            version); stored verbatim in ``run_started`` so ``tools/inspect`` shows what was run.

    Raises:
        ConfigError: a bad argument (named with the value received).
    """

    def __init__(
        self,
        net: nn.Module,
        optimizer: Optimizer | Mapping[str, Optimizer],
        loss: Any,
        *,
        monitor: Monitor | str | None = None,
        metrics: Sequence[str] = (),
        schedulers: Sequence[Any] = (),
        callbacks: Sequence[Callback] = (),
        hooks: Sequence[Any] = (),
        accumulation: int = 1,
        clip_grad_norm: float | None = None,
        precision: str = "fp32",
        track_grad_norm: bool = False,
        train_step_fn: Callable[..., Any] | None = None,
        eval_step_fn: Callable[..., Any] | None = None,
        trainer_step_fn: Callable[[TrainContext, Any], Any] | None = None,
        validate_every: int = 1,
        validate_every_steps: int | None = None,
        phase_every: int | None = None,
        keep_phases: int | None = None,
        checkpoint_lag: int | str = 0,
        runs_root: str | Path = "runs",
        run_id: str | None = None,
        seed: int = 0,
        progress: bool | None = None,
        batch_gather: bool = True,
        recipe: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(net, nn.Module):
            raise ConfigError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        self.net = net
        if isinstance(optimizer, Optimizer):
            optimizer = {type(optimizer).__name__.lower(): optimizer}
        if (not isinstance(optimizer, Mapping) or not optimizer
                or not all(isinstance(o, Optimizer) for o in optimizer.values())):
            raise ConfigError(f"optimizer must be a torch Optimizer or a non-empty {{name: Optimizer}}, got {optimizer!r}")
        self.optimizers: dict[str, Optimizer] = dict(optimizer)
        own = {id(p) for p in net.parameters()}
        for name, opt in self.optimizers.items():
            foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in own)
            if foreign:
                raise ConfigError(
                    f"optimizer {name!r} holds {foreign} parameter(s) that are not the net's: build it over "
                    "net.parameters(), or it would step nothing the net uses"
                )
        if not (isinstance(loss, (Objective, Mapping, nn.Module)) or callable(loss)):
            raise ConfigError(f"loss must be a loss module, a callable, {{name: fn}} or an Objective, got {loss!r}")
        self.objective = loss if isinstance(loss, Objective) else Objective(loss)
        if isinstance(monitor, str):
            monitor = Monitor(monitor, mode="max" if "acc" in monitor else "min")
        if monitor is not None and not isinstance(monitor, Monitor):
            raise ConfigError(f"monitor must be a Monitor or a metric name, got {monitor!r}")
        self.monitor: Monitor | None = monitor
        if isinstance(schedulers, (Scheduler, Callback)) or not isinstance(schedulers, Iterable):
            raise ConfigError(f"schedulers must be a list, got {schedulers!r}")
        if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
            raise ConfigError(f"callbacks must be a list of Callback, got {callbacks!r}")
        callbacks = list(callbacks)
        self.schedulers = self._wrap_schedulers(schedulers)
        #: the schedulers on the optimizer_update clock (stepped after each committed update)
        self.update_clock = [s for s in self.schedulers if s.clock == "optimizer_update"]
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise ConfigError(f"callbacks must be nnx_es.Callback instances, got {type(cb).__name__}")
        names = [cb.name for cb in callbacks]
        if len(set(names)) != len(names):
            raise ConfigError(f"callback names must be unique (they key checkpoint state), got {names}")
        self.callbacks = list(callbacks)
        check_cadences(validate_every=validate_every, validate_every_steps=validate_every_steps,
                       phase_every=phase_every, keep_phases=keep_phases)
        self.validate_every = validate_every
        self.validate_every_steps = validate_every_steps
        self.phase_every = phase_every
        self.keep_phases = keep_phases
        self.eval_step_fn = eval_step_fn or default_forward
        self.trainer_step_fn = trainer_step_fn or default_train_step
        self.custom_step = trainer_step_fn is not None
        closure = [n for n, o in self.optimizers.items() if isinstance(o, torch.optim.LBFGS)]
        if closure and not self.custom_step:
            raise ConfigError(f"optimizer {closure[0]!r} is LBFGS, whose step() re-evaluates the loss through a "
                              "closure; the update engine steps once per window without one: pass a trainer_step_fn "
                              "that calls opt.step(closure) and ctx.report_update(...)")
        check_run_args(runs_root=runs_root, seed=seed, progress=progress, batch_gather=batch_gather, recipe=recipe)
        self.runs_root = Path(runs_root)
        self.run_id = validate_run_id(run_id) if run_id is not None else None
        self.seed = int(seed)  # a NumPy integer too
        self.progress_enabled = progress
        self.batch_gather = batch_gather
        self.recipe = dict(recipe or {})
        self.world_size = 1
        self.metrics = validate_metrics(metrics)
        if self.monitor is not None:
            known = {"loss", *self.objective.terms, *self.metrics} if len(self.objective.terms) > 1 else {
                "loss", *self.metrics}
            base = self.monitor.name.removeprefix("val_")
            if base not in known:
                raise ConfigError(
                    f"monitor {self.monitor.name!r} names no reported metric; this run reports "
                    f"{sorted(known)} for training and the same with val_ for validation (declare metrics=[...])"
                )
        if not isinstance(track_grad_norm, bool):
            raise ConfigError(f"track_grad_norm must be True or False, got {track_grad_norm!r}")
        self.engine = UpdateEngine(self, self.objective, train_step_fn=train_step_fn,
                                   track_grad_norm=track_grad_norm)
        self.engine.metrics = self.metrics
        update_hooks, stage_hooks = collect(hooks)
        for kwarg, value, default, cls in (("accumulation", accumulation, 1, GradientAccumulation),
                                           ("clip_grad_norm", clip_grad_norm, None, GradientClipping),
                                           ("precision", precision, "fp32", MixedPrecision)):
            if value != default and any(isinstance(h, cls) for h in update_hooks):
                raise ConfigError(f"{kwarg}={value!r} and a {cls.__name__} hook both configure the same thing; "
                                  "give one of them")
        if accumulation != 1:
            update_hooks.append(GradientAccumulation(accumulation))
        if clip_grad_norm is not None:
            update_hooks.append(GradientClipping(clip_grad_norm))
        if precision != "fp32":
            update_hooks.append(MixedPrecision(precision))
        self.update_hooks = update_hooks
        self.engine.use_hooks(update_hooks, stage_hooks)
        self.stages = self.engine.stages
        self._hooks = {
            hook: [cb for cb in self.callbacks if (cb.has(hook) if isinstance(cb, LambdaCallback) else type(cb).overrides(hook))]
            for hook in ("on_train_begin", "on_epoch_begin", "on_batch_end", "on_optimizer_update",
                         "on_validation_end", "on_epoch_end", "on_train_end")
        }
        self.run_dir: Path | None = None
        self.recorder: Recorder = None  # type: ignore[assignment]  # set by fit()
        self.ctx = TrainContext(self)
        self._stop: tuple[str, str] | None = None
        self._microbatch_recorded = False
        self._committed_update = False
        self._unreported = 0  # microbatches a custom step recorded since its last reported update
        self.committer = Committer(self, checkpoint_lag)
        #: the train and validation loaders' own generators ("train", "val"), checkpointed with the RNG streams
        self.generators: dict[str, LoaderGenerators] = {}
        #: the projections finalization wrote the views from, and the log's length then
        self.final_projection: tuple[Projections, int] | None = None

    # --- configuration helpers ----------------------------------------------------------

    def _wrap_schedulers(self, schedulers: Iterable[Any]) -> list[Scheduler]:
        out: list[Scheduler] = []
        seen: set[str] = set()
        for s in schedulers:
            w = s if isinstance(s, Scheduler) else Scheduler(s)
            if w.name in seen:
                if isinstance(s, Scheduler) and s.named:
                    raise ConfigError(f"scheduler names must be unique (they key events and checkpoints), "
                                      f"{w.name!r} is given twice")
                w.name = f"{w.name}{len(out)}"
            seen.add(w.name)
            owner = [n for n, o in self.optimizers.items() if o is w.optimizer]
            if not owner:
                raise ConfigError(f"scheduler {w.name!r} wraps an optimizer that is not among the trainer's optimizers")
            w.optimizer_name = owner[0]
            if w.plateau and self.monitor is None:
                raise ConfigError(f"scheduler {w.name!r} is a ReduceLROnPlateau: it needs Trainer(monitor=...)")
            out.append(w)
        return out

    # --- dispatch -----------------------------------------------------------------------

    def _dispatch(self, hook: str, *args: Any) -> None:
        for cb in self._hooks[hook]:
            getattr(cb, hook)(*args)

    def _request_stop(self, reason: str, by: str) -> None:
        if self._stop is None:
            self._stop = (reason, by)

    def _ensure_microbatch_recorded(self, ctx: TrainContext, *, loss: float | None, examples: float) -> None:
        if not self._microbatch_recorded:
            self._microbatch_recorded = True
            self.engine.epoch.microbatches += 1
            self._unreported += 1
            rows = len(ctx.batch[0]) if isinstance(ctx.batch, (tuple, list)) and hasattr(ctx.batch[0], "__len__") else 1
            self.recorder.emit(
                MicrobatchDone(
                    epoch=ctx.epoch, batch=ctx.batch_index, rows=rows, examples=float(examples),
                    loss=float(loss) if loss is not None else math.nan,
                )
            )

    # --- the run ------------------------------------------------------------------------

    def fit(
        self,
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None = None,
        *,
        epochs: int,
        resume_from: str | Path | None = None,
        resume_mode: str = "stateful",
    ) -> RunResult:
        """Train until epoch ``epochs - 1`` (0-based) and return the run.

        Args:
            resume_from: a run directory (``runs/<id>``). ``resume_mode="stateful"``
                continues that run from its LAST commit: model, optimizers,
                schedulers, RNG streams (the train and validation loaders' own
                generators included: their states, not seeds), counters, callback
                state and data position are restored, the uncommitted tail is
                recorded as discarded, and training goes on at the first
                uncommitted epoch (a run that had decided to stop is finished
                without training more). The trainer must declare the run's recipe:
                the same optimizers, schedulers, monitor, window and EMA hooks.
                ``"weights_only"`` starts a new run (this trainer's ``run_id``)
                from the weights alone and records its source (run id, LAST seq,
                manifest hash). Semantics: spec 004 "Restart semantics".

        Raises:
            ConfigError: bad ``epochs``/``resume_mode``, or a run directory in the way.
            ResumeError: the resume point is missing or does not verify, the recipe
                differs from the run's, or a loader has or lacks a generator of its own
                the run's had (the reason is named; nothing is restored or erased).
            LeaseHeldError: another process writes this run.
            Exception: whatever training raised, after finalization.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ConfigError(f"epochs must be an int >= 0, got {epochs!r}")
        if val_loader is None and self.monitor is not None and self.monitor.name.startswith("val_"):
            raise ConfigError(f"monitor {self.monitor.name!r} needs a validation loader: fit(train, val, ...)")
        if resume_mode not in ("stateful", "weights_only"):
            raise ConfigError(f"resume_mode must be 'stateful' or 'weights_only', got {resume_mode!r}")
        ensure_logging()
        self.generators = {"train": LoaderGenerators.of(train_loader), "val": LoaderGenerators.of(val_loader)}
        self.loaders = {"train": train_loader, "val": val_loader}  # their geometry is declared in run_started
        self.final_projection = None
        with open_session(self, resume_from, resume_mode, epochs) as (opening, start_epoch):
            self._run(train_loader, val_loader, epochs, opening, start_epoch)
        assert self.run_dir is not None
        if self.final_projection is not None:  # the log as finalization projected it for the views
            projections, n_events = self.final_projection
            return result_of(projections, self.run_dir, n_events)
        return load_result(self.run_dir)

    def _run(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int,
             opening: RunStarted | RunResumed, start_epoch: int) -> None:
        rec = self.recorder
        t0 = time.time()
        ctx = self.ctx
        begun: list[tuple[int, Callback]] = []
        failure: BaseException | None = None
        stopped_at_update = False
        self.progress = Progress(self.progress_enabled)
        try:
            if isinstance(opening, RunResumed):
                rec.commit(opening)  # the discarded range is durable before anything new is written
            else:
                rec.emit(opening)
            ctx.epoch = start_epoch
            for i, cb in enumerate(self.callbacks):
                cb.on_train_begin(ctx)
                rec.emit(CallbackBegan(name=cb.name, index=i))
                begun.append((i, cb))
            n_batches = len(train_loader) if hasattr(train_loader, "__len__") else None  # type: ignore[arg-type]
            covers = rec.emit(TrainBegan(start_epoch=start_epoch, epochs=epochs, train_batches=n_batches))
            if isinstance(opening, RunStarted) and self.committer.lag > 0:
                # a new run's opening checkpoint persists while its first epoch trains; its LAST,
                # appended like any deferred LAST, commits the opening events (up to train_began)
                self.committer.submit(epoch=start_epoch - 1, covers=covers, group=False, opening=True)
            else:
                self._commit_last(epoch=start_epoch - 1)
            rec.flush()
            if self._stop is not None:  # resumed after the run had decided to stop: finish it
                rec.emit(StopRequested(epoch=start_epoch - 1, step=ctx.step_count, reason=self._stop[0],
                                       by=self._stop[1]))
            self.stages(TrainingStage.BEFORE_TRAINING, ctx)
            for epoch in range(start_epoch, epochs if self._stop is None else start_epoch):
                outcome = self._run_epoch(epoch, train_loader, val_loader, last=epoch == epochs - 1)
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
        self._finalize(begun, failure, stopped_at_update, t0)
        if failure is not None:
            raise failure

    def _run_epoch(self, epoch: int, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, *, last: bool) -> str | None:
        rec, ctx, engine = self.recorder, self.ctx, self.engine
        ctx.epoch, ctx.decision, ctx.validation = epoch, None, ctx.validation
        t_epoch = time.time()
        rec.emit(EpochBegan(epoch=epoch, wall_time_s=t_epoch))
        engine.begin_epoch()
        self.net.train()
        self._dispatch("on_epoch_begin", ctx)
        self.stages(TrainingStage.BEFORE_EPOCH, ctx)
        self.progress.start_epoch(epoch, len(train_loader) if hasattr(train_loader, "__len__") else None)  # type: ignore[arg-type]
        step_fn = self.trainer_step_fn
        # the per-batch loop: what is absent (stage hooks, batch callbacks, progress, step
        # validation) is decided once per epoch, not per batch
        stages = self.stages if self.stages.by_stage else None
        on_batch_end = self._hooks["on_batch_end"]
        progress = self.progress if self.progress.enabled else None
        validate_on_step = val_loader is not None and self.validate_every_steps is not None
        committer = self.committer
        for i, batch in enumerate(iterate_batches(train_loader, gather=self.batch_gather)):
            ctx.batch_index, ctx.batch = i, batch
            self._microbatch_recorded = False
            self._committed_update = False
            if stages:
                stages(TrainingStage.BEFORE_BATCH, ctx)
            out = step_fn(ctx, batch)
            if self.custom_step and not self._microbatch_recorded:
                self._ensure_microbatch_recorded(ctx, loss=float(out) if out is not None else None, examples=0.0)
            if validate_on_step and self._committed_update:
                self._maybe_validate_on_step(val_loader)
            for cb in on_batch_end:
                cb.on_batch_end(ctx)
            if stages:
                stages(TrainingStage.AFTER_BATCH, ctx)
            if progress:
                progress.advance(ctx.loss, ctx.step_count, ctx.rows)
            if self._committed_update:
                self._unreported = 0
                if committer.pending is not None:
                    committer.on_update()
                rec.maybe_flush()
                if ctx.stop_at_update_requested:
                    rec.emit(StopRequested(epoch=epoch, step=ctx.step_count, reason="update_boundary"))
                    return "update_boundary"
        if self.custom_step and rec.lifecycle.state.rstrip("~^") == "in_window":
            # the custom step recorded microbatches but reported no update for them: say so
            rec.emit(UpdateSkipped(step=ctx.step_count, epoch=epoch, microbatches=self._unreported,
                                   reason="unreported", optimizer=",".join(self.optimizers)))
            self._unreported = 0
        if engine.finalize_step(ctx):
            self.committer.on_update()
            self._maybe_validate_on_step(val_loader)
            if ctx.stop_at_update_requested:
                rec.emit(StopRequested(epoch=epoch, step=ctx.step_count, reason="update_boundary"))
                return "update_boundary"
        # validation, summary, decision, schedulers
        val: dict[str, float] = {}
        if val_loader is not None and ((epoch + 1) % self.validate_every == 0 or last):
            val = self._validation_pass(val_loader)
        totals = engine.epoch
        train = totals.sums.metrics()
        if totals.microbatches == 0:
            log.warning("epoch had no microbatch: the train loader is empty or exhausted", run_id=self.run_id,
                        epoch=epoch)
        elif totals.updates == 0 and not self.custom_step:
            log.warning("epoch committed no optimizer update: every window was skipped", run_id=self.run_id,
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
        for s in self.schedulers:
            if s.clock != "epoch":
                continue
            if s.plateau:
                if decision is None:
                    continue  # no decision this epoch: a plateau scheduler does not step
                step_plateau(s.scheduler, decision)
            else:
                s.scheduler.step()
            s.steps += 1
            rec.emit(SchedulerStepped(
                name=s.name, clock=s.clock, epoch=epoch, step=ctx.step_count, steps=s.steps, lrs=s.lrs(),
                plateau=s.plateau_state(),
            ))
        self._dispatch("on_epoch_end", ctx)
        self.stages(TrainingStage.AFTER_EPOCH, ctx)
        if self._stop is not None:
            rec.emit(StopRequested(epoch=epoch, step=ctx.step_count, reason=self._stop[0], by=self._stop[1]))
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
        self.progress.end_epoch(epoch, record)
        log.info("epoch committed", run_id=self.run_id, epoch=epoch, **record.train, **record.val,
                 improved=record.improved)
        return "stop" if self._stop is not None else None

    # --- validation -----------------------------------------------------------------------

    def _validation_pass(self, loader: Iterable[Any], trigger: str = "epoch") -> dict[str, float]:
        ctx = self.ctx
        val, n_val = self.validate(loader)
        ctx.validation = val
        self.recorder.emit(
            ValidationDone(epoch=ctx.epoch, metrics=val, examples=n_val, step=ctx.step_count, trigger=trigger)
        )
        self._dispatch("on_validation_end", ctx, val)
        self.stages(TrainingStage.AFTER_VALIDATION, ctx)
        return val

    def _maybe_validate_on_step(self, loader: Iterable[Any] | None) -> None:
        n = self.validate_every_steps
        if loader is not None and n is not None and self.ctx.step_count % n == 0:
            self._validation_pass(loader, "steps")

    def validate(self, loader: Iterable[Any]) -> tuple[dict[str, float], int]:
        """Evaluate on ``loader`` in eval mode; return (``val_`` metrics, rows scored).

        With an :class:`~nnx_es.update_hooks.EMA` update hook, the averaged weights are evaluated.
        """
        net = self.engine.orchestrator.averaged_module() or self.net
        return evaluate(net, loader, self.objective, self.eval_step_fn, self.metrics, gather=self.batch_gather)

    # --- checkpoints ----------------------------------------------------------------------

    def _commit_last(self, *, epoch: int, final: bool = False) -> str | None:
        """Commit LAST now (synchronously): the initial checkpoint and the refresh after finalization.

        The final refresh names the last commit's manifest again, without capturing, when
        nothing can have changed the state since: the counters are the same and no callback
        ``on_train_end`` or ``AFTER_TRAINING`` stage hook ran.
        """
        self.committer.complete()
        if final and not finalization_may_change_state(self):
            if self.committer.recommit_final(epoch=epoch):
                return None
        self.committer.submit(epoch=epoch, final=final, group=False)
        return None

    # --- finalization ---------------------------------------------------------------------

    def _finalize(self, begun: list[tuple[int, Callback]], failure: BaseException | None,
                  stopped_at_update: bool, t0: float) -> None:
        finalize(self, begun, failure, stopped_at_update, t0)
