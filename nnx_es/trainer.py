"""The Trainer: the training loop as a walk through the lifecycle machine.

It checks its arguments and builds, once, what every ``fit`` runs with (a
:class:`~nnx_es.runtime.scope.RunPlan`); each ``fit`` opens a session and builds its run
(:class:`~nnx_es.runtime.scope.RunScope`), whose loop walks the lifecycle machine in the order
:mod:`nnx_es.runtime.loop` gives as pseudocode.

Semantics follow spec 000 ("Lifecycle order", durable commit order, failure
semantics) and spec 004 (counters, stages).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from events.schema import DigestCadence, RunStarted, SourceRef, UpdateSpec
from nnx_es.argchecks import (check_batch_callback, check_cadences, check_fit_args, check_run_args, check_settings,
                              monitor_of, optimizers_of)
from nnx_es.batches import weighted_forward
from nnx_es.callbacks import Callback, CallbackList
from nnx_es.runtime.commit import checkpoint_lag as lag_in_updates
from nnx_es.declare import describe_objective
from nnx_es.device import place_model, resolve_device
from nnx_es.distributed.alike import check_trainer_alike
from nnx_es.distributed.roles import check_declared, for_rank
from nnx_es.distributed.resize import fit_engine
from nnx_es.distributed.wrap import check_distributed, data_parallel, is_writer_rank
from nnx_es.errors import ConfigError
from nnx_es.evaluation import weights_fingerprint
from nnx_es.finetune import group_names, initial_weights
from nnx_es.loaders import loader_geometries
from nnx_es.logs import ensure_logging
from nnx_es.metrics import check_accuracy, check_metric_names, check_monitor, evaluate, validate_metrics
from nnx_es.models import ModelSet, step_functions
from nnx_es.monitor import Monitor
from nnx_es.objective import Objective
from nnx_es.recipes.runspec import record_spec, spec_hash
from nnx_es.runtime.recording import Recorder
from nnx_es.result import RunResult, load_result, result_of
from nnx_es.retention import check_retention
from nnx_es.rows.journal import HistoryJournal, check_history
from nnx_es.rows.recorder import RowRecorder
from nnx_es.runtime.run_state import RunState
from nnx_es.runtime.context import TrainContext
from nnx_es.runtime.engine import UpdateEngine, default_forward
from nnx_es.runtime.loop import Cadence, LoopSettings
from nnx_es.runtime.scope import CommitSettings, RunPlan, RunScope
from nnx_es.runtime.steps import default_train_step
from nnx_es.schedulers import wrap_schedulers
from nnx_es.runtime.session import library_versions, new_run_id, open_session
from nnx_es.runtime.components import RunComponents
from nnx_es.stages import StageDispatcher
from nnx_es.storage import BlobStore, validate_run_id
from nnx_es.transforms.callback import Transform, check_trained, opening_events, prepare
from nnx_es.update_hooks import UpdateOrchestrator, collect, settings_of
from nnx_es.user_metrics import bind_activation, check_recordable, higher_is_better, metric_names

__all__ = ["Trainer"]


class Trainer:
    """Trains ``net`` and records every lifecycle transition in the run's event log.

    Args:
        net: the model (``nn.Module``); checkpoints hold its ``state_dict``. Or several models,
            ``{"student": s, "teacher": t}`` (:mod:`nnx_es.models`: trainable ones checkpointed by
            name, frozen ones declared by hash); such a run needs ``training_fn``.
        optimizer: one optimizer, or ``{name: optimizer}`` for several (they step together).
        loss: the objective: a loss module/callable returning per-row losses, ``{name: fn or (fn, weight)}``,
            or an :class:`~nnx_es.objective.Objective` (:mod:`nnx_es.objective`).
        monitor: :class:`~nnx_es.monitor.Monitor` or a metric name (``"val_loss"``; mode ``max`` when it
            contains ``acc``): one decision per validated epoch drives BEST, ReduceLROnPlateau, EarlyStopping.
        metrics: declared metrics besides the loss, per epoch for training and validation, exact over
            the epoch's rows and monitorable by name: ``"accuracy"`` (``(B, C)`` logits against ``(B,)``
            class ids, or one logit ``(B, 1)`` against 0/1 targets; other shapes refused on the first
            batch), named callables ``(outputs, targets) -> per-row values``, ``torchmetrics`` metrics
            (:mod:`nnx_es.user_metrics`).
        schedulers: torch schedulers (epoch clock) or :class:`~nnx_es.schedulers.Scheduler`.
        callbacks: :class:`~nnx_es.callbacks.Callback` objects, dispatched in list order.
        hooks: stage hooks (:mod:`nnx_es.stages`) and update hooks (:mod:`nnx_es.update_hooks`).
        accumulation: microbatches per optimizer update (shortcut for ``GradientAccumulation``).
        clip_grad_norm: max total gradient L2 norm (shortcut for ``GradientClipping``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (shortcut for ``MixedPrecision``).
        track_grad_norm: record every update's gradient norm before clipping (``update_committed.grad_norm``).
        sample_weights: declare per-row loss weights ``(B,)``, >= 0, as a batch's third element (the
            loss is the weighted mean; weight 0 masks a row). The batch contract (:mod:`nnx_es.batches`):
            ``(inputs, targets)``, ``(inputs, targets, weights)`` only with ``sample_weights=True``, or
            ``{"x", "y", "weight"?}``; anything else is refused on the first batch it appears in.
        train_step_fn / eval_step_fn: ``fn(net, batch) -> (outputs, targets, weights|None)``: your reading of a batch.
        trainer_step_fn: ``fn(ctx, batch)`` replacing the microbatch+update path (reports ``ctx.report_update``).
        validate_every: validate every N epochs (and after the last epoch).
        validate_every_steps: also validate every N committed updates (no monitor decision).
        phase_every / keep_phases: a phase checkpoint every N epochs; keep the newest K.
        keep_last / keep_best: checkpoint retention (:mod:`nnx_es.retention`): the newest ``keep_last``
            LASTs' and BEST's checkpoints are kept (``None``: every one), others pruned (``checkpoint_pruned``).
        checkpoint_lag: 0 commits each epoch's LAST at its end; N > 0 appends it after N committed updates
            of the next epoch, ``"epoch"`` at its end (:mod:`nnx_es.runtime.commit`): a crash may lose that much more.
        runs_root: the directory holding ``<run_id>/`` and ``.leases/``.
        run_id: ``[A-Za-z0-9._-]{1,128}``; default: a timestamp and random suffix.
        seed: seeds Python, numpy and torch before training (rank ``r`` of several:
            :func:`nnx_es.rng.rank_seed` ``(seed, r)``).
        progress: show a progress display (default: when stderr is a terminal).
        batch_gather: fetch each batch of a ``DataLoader`` over a ``TensorDataset`` with one index per
            tensor -- the same batches and RNG draws (:mod:`nnx_es.data`); ``False``: loaders as given.
        recipe: your run's configuration as JSON-like builtins, stored verbatim in ``run_started``.
        recipe_required / spec: record the run's spec (:mod:`nnx_es.recipes`) in ``run_started``, refusing
            now what cannot be recovered; ``spec``: the ``RunSpec`` this trainer was built from.
        sinks: live logging (:mod:`nnx_es.sinks`: ``TensorBoardSink``, ``CsvSink``, ``MlflowSink``), fed
            the committed events; a failing sink is warned about and dropped, never failing the run.
        nonfinite: what a non-finite loss, gradient or validation metric does: ``"skip"`` the update
            (a ``NonFiniteWarning`` each epoch), ``"stop"`` the run after committing the epoch, or
            ``"raise"`` ``NonFiniteError`` (:class:`~nnx_es.runtime.loop.LoopSettings`). A run that
            commits no update never ends ``completed`` (:class:`~nnx_es.errors.NoUpdateError`).
        history: where per-row records go (:mod:`nnx_es.rows`): the log (``None``) or a ``HistoryJournal``.
        device: where to train (``"cpu"``, ``"cuda:N"``, ``"mps"``, a ``torch.device``; default: the
            model's): the model and optimizer state move there now, every batch's tensors before the
            batch's stages (:mod:`nnx_es.device`); a device this machine lacks is refused now.
        distributed: :class:`nnx_es.distributed.DDP` to train data-parallel in the process group
            ``torchrun`` started (spec 000 §3; :mod:`nnx_es.distributed`): only its writer rank writes
            the run. Refused with it: BatchNorm layers, a ``trainer_step_fn``, ``precision="fp16"``
            (:func:`nnx_es.distributed.wrap.check_distributed`); without it, one rank of several.
        val_batch_callback: ``fn(*, batch, predictions, loss, batch_count, step_count, epoch)`` after
            each validation batch: its outputs ``(B, ...)``, mean loss (float), 0-based index in the
            pass, the committed updates, the 0-based epoch (spec 004 "Per-batch validation callback").
        final_validation: a validation pass on the final weights once training ends (``trigger="final"``,
            no monitor decision): ``True`` always, ``"auto"`` when they are not the ones last validated,
            ``False`` never.
        init_from: a fine-tuning run's initial weights, loaded now: a :class:`~nnx_es.finetune.WeightsFrom`
            or a ``state_dict`` (strict); recorded in ``run_started.lineage``.
        training_fn: several models: ``training_fn(models, batch) -> {key: tensor}`` predictions
            (``models``: every model by name), for training and validation.
        loss_target_assembler: several models: ``fn(loss, predictions, batch, *, workflow, target_keys)
            -> {key: tensor}`` targets when they do not come from the batch (:func:`nnx_es.models.multi_model_step`).
        target_keys: the target keys handed to the assembler (default: those the ``Keyed`` terms read).
        transforms: model transforms (:mod:`nnx_es.transforms`) applied to ``net`` now, in order; each is a
            ``model_transformed`` event, in every checkpoint's topology, rebuilt by a resume or ``NNModel.load``.

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
        metrics: Sequence[Any] | Mapping[str, Any] = (),
        schedulers: Sequence[Any] = (),
        callbacks: Sequence[Callback] = (),
        hooks: Sequence[Any] = (),
        accumulation: int = 1, clip_grad_norm: float | None = None, precision: str = "fp32",
        track_grad_norm: bool = False,
        sample_weights: bool = False,
        train_step_fn: Callable[..., Any] | None = None, eval_step_fn: Callable[..., Any] | None = None,
        trainer_step_fn: Callable[[TrainContext, Any], Any] | None = None,
        validate_every: int = 1, validate_every_steps: int | None = None,
        phase_every: int | None = None, keep_phases: int | None = None,
        keep_last: int | None = 1, keep_best: bool = True,
        checkpoint_lag: int | str = 0,
        runs_root: str | Path = "runs", run_id: str | None = None,
        seed: int = 0,
        progress: bool | None = None,
        batch_gather: bool = True,
        recipe: Mapping[str, Any] | None = None,
        nonfinite: str = "skip", sinks: Sequence[Any] = (), recipe_required: bool = False, spec: Any = None,
        device: str | torch.device | None = None,
        distributed: Any = None,
        val_batch_callback: Callable[..., Any] | None = None,
        final_validation: bool | str = "auto",
        init_from: Any = None,
        training_fn: Callable[..., Any] | None = None, loss_target_assembler: Callable[..., Any] | None = None,
        target_keys: Sequence[str] | None = None,
        history: HistoryJournal | None = None,
        transforms: Sequence[Transform] = (),
    ) -> None:
        self.custom_step = trainer_step_fn is not None
        self.transforms = prepare(net, transforms)  # before the optimizers are checked against the net's parameters
        several = isinstance(net, Mapping)
        if several:  # several models (distillation): nnx_es.models
            self.optimizers: dict[str, Optimizer] = optimizers_of(nn.ModuleDict(dict(net)), optimizer,
                                                                  custom_step=self.custom_step)
            net = ModelSet(net, self.optimizers)
        if not isinstance(net, nn.Module):
            raise ConfigError(f"net must be a torch.nn.Module or {{name: nn.Module}}, got {type(net).__name__}")
        self.distributed = check_distributed(distributed, net, trainer_step_fn=trainer_step_fn, precision=precision)
        self.net = net
        if not several:
            self.optimizers = optimizers_of(net, optimizer, custom_step=self.custom_step)
        check_trained(net, self.optimizers)
        #: where the initial weights came from (``init_from``), recorded in ``run_started``
        self.lineage = initial_weights(net, init_from)
        self.device = resolve_device(device, net)
        place_model(net, self.optimizers, self.device)
        check_settings(loss=loss, callbacks=callbacks, final_validation=final_validation, sample_weights=sample_weights,
                       nonfinite=nonfinite, sinks=sinks, track_grad_norm=track_grad_norm)
        self.objective = loss if isinstance(loss, Objective) else Objective(loss)
        self.val_batch_callback = check_batch_callback(val_batch_callback)
        self.metrics = validate_metrics(metrics)
        check_metric_names(self.objective, self.metrics)
        check_accuracy(self.objective, self.metrics, models=list(net.models) if isinstance(net, ModelSet) else ())
        bind_activation(self.metrics, (t.fn for t in self.objective.terms.values()))
        self.monitor: Monitor | None = monitor_of(monitor, higher_is_better(self.metrics))
        self.schedulers = wrap_schedulers(schedulers, self.optimizers, self.monitor)
        callbacks = CallbackList(callbacks).callbacks  # checked now; listed again per fit
        if self.distributed is not None:
            check_declared(callbacks, history)  # on every rank, before training
        self.callbacks: list[Callback] = for_rank(callbacks, is_writer=self.distributed is None or is_writer_rank(
            self.distributed))
        check_cadences(validate_every=validate_every, validate_every_steps=validate_every_steps,
                       phase_every=phase_every, keep_phases=keep_phases)
        check_retention(keep_last, keep_best)
        forward = weighted_forward if sample_weights else default_forward
        train_step_fn, eval_step_fn = step_functions(net, self.objective, train_step_fn, eval_step_fn,
                                                     training_fn, loss_target_assembler, target_keys)
        self.eval_step_fn = eval_step_fn or forward
        check_run_args(runs_root=runs_root, seed=seed, progress=progress, batch_gather=batch_gather, recipe=recipe)
        self.runs_root = Path(runs_root)
        self.run_id = validate_run_id(run_id) if run_id is not None else None
        self.run_dir: Path | None = None
        self.seed = int(seed)  # a NumPy integer too
        self.batch_gather = batch_gather
        self.recipe = dict(recipe or {})
        if self.monitor is not None:
            check_monitor(self.monitor, self.objective, self.metrics)
        update_hooks, stage_hooks = collect(hooks)
        self.update_hooks, settings = settings_of(update_hooks, accumulation=accumulation,
                                                  clip_grad_norm=clip_grad_norm, precision=precision,
                                                  track_grad_norm=track_grad_norm)
        self.stages = StageDispatcher(stage_hooks)
        self.engine = UpdateEngine(net, self.optimizers, self.objective, settings,
                                   train_step_fn=train_step_fn or forward, stages=self.stages,
                                   orchestrator=UpdateOrchestrator(self.update_hooks))
        for h in self.update_hooks:
            h.configure(self.engine)
        self.history = check_history(history)
        #: the per-row records of the latest ``fit`` (``None`` before the first)
        self.rows: RowRecorder | None = None
        #: what every fit runs with
        self.plan = RunPlan(
            engine=self.engine, schedulers=self.schedulers, monitor=self.monitor, metrics=self.metrics,
            callbacks=self.callbacks, stages=self.stages, history=self.history, validate=self.validate,
            loop=LoopSettings(cadence=Cadence(validate_every, validate_every_steps),
                              step_fn=trainer_step_fn or default_train_step, custom_step=self.custom_step,
                              batch_gather=batch_gather, nonfinite=nonfinite, device=self.device,
                              final_validation=final_validation),
            commit=CommitSettings(lag=lag_in_updates(checkpoint_lag), phase_every=phase_every, keep_phases=keep_phases,
                                  keep_last=keep_last, keep_best=keep_best),
            progress=progress, digest_every=self.distributed.digest_every if self.distributed is not None else None,
            sinks=list(sinks), trainer=self)
        #: the context of the latest ``fit`` (``None`` before the first)
        self.ctx: TrainContext | None = None
        check_recordable(self.metrics, recorded=recipe_required or spec is not None)
        self.spec = record_spec(
            recipe_required, spec, net=net, optimizers=self.optimizers, objective=self.objective, monitor=self.monitor,
            metrics=metric_names(self.metrics), schedulers=self.schedulers, callbacks=self.callbacks, update_hooks=self.update_hooks,
            hooks=hooks, steps={"train_step_fn": train_step_fn, "eval_step_fn": eval_step_fn,
                                "trainer_step_fn": trainer_step_fn}, seed=self.seed, transforms=self.transforms,
            settings=dict(validate_every=validate_every, validate_every_steps=validate_every_steps, phase_every=phase_every,
                          keep_phases=keep_phases, checkpoint_lag=checkpoint_lag, sample_weights=sample_weights,
                          track_grad_norm=track_grad_norm, batch_gather=batch_gather, keep_last=keep_last,
                          keep_best=keep_best, nonfinite=nonfinite))
        #: the run of the latest ``fit`` (``None`` before the first)
        self.state: RunState | None = None

    @property
    def recorder(self) -> Recorder:
        """The latest run's recorder (raises ``AttributeError`` before the first ``fit``)."""
        return self._latest("recorder").recorder

    @property
    def store(self) -> BlobStore:
        """The latest run's blob store (raises ``AttributeError`` before the first ``fit``)."""
        return self._latest("store").store

    def _latest(self, what: str) -> RunState:
        if self.state is None:
            raise AttributeError(f"{what}: this trainer has not opened a run yet (call fit)")
        return self.state

    def _declare(self, components: RunComponents, run_id: str, source: SourceRef | None) -> RunStarted:
        """This trainer's ``run_started``: what a stateful resume must declare again."""
        return RunStarted(
            run_id=run_id, seed=self.seed, recipe=self.recipe, library_versions=library_versions(),
            callbacks=[cb.name for cb in self.callbacks], optimizers=list(self.optimizers),
            schedulers=[s.decl() for s in self.schedulers],
            monitor=self.monitor.spec if self.monitor else None, accumulation=components.engine.accumulation,
            update=UpdateSpec(precision=self.engine.precision, clip_grad_norm=self.engine.clip_grad_norm),
            source=source, wall_time_s=time.time(), loaders=loader_geometries(components.loaders),
            spec=self.spec, spec_hash=spec_hash(self.spec), objective=describe_objective(self.objective),
            lineage=self.lineage, param_groups=group_names(self.optimizers),
            models=self.net.declare() if isinstance(self.net, ModelSet) else None,
            world_size=components.world.size, writer_rank=components.world.writer_rank,
            history=repr(self.history) if self.history is not None else "none",
            digests=DigestCadence(every=self.distributed.digest_every)
            if self.distributed is not None and components.world.distributed else None,
            initial_weights=weights_fingerprint(self.net) if source is None else "",
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
        resume: str | None = None,
        resume_at: int | str | None = None,
    ) -> RunResult:
        """Train until epoch ``epochs - 1`` (0-based) and return the run.

        Args:
            resume_from: a run directory (``runs/<id>``). ``resume_mode="stateful"`` continues that run
                from its LAST commit (everything restored: model, optimizers, schedulers, RNG streams,
                counters, callback state, data position; the uncommitted tail recorded as discarded);
                the trainer must declare the run's recipe. ``"weights_only"`` starts a new run from
                its weights alone; ``"fork"`` a new run from its whole state, counting from 0.
                Semantics: spec 004 "Restart semantics" (:mod:`nnx_es.runtime.session`).
            resume_at: with ``"weights_only"`` or ``"fork"``, the source's checkpoint to start from: the
                seq of one of its committed LASTs, or ``"best"`` (default: its latest LAST).
            resume: ``"auto"``: resume this trainer's ``run_id`` statefully when it has a committed LAST,
                otherwise start it afresh (what a run without one left is cleared; a LAST that does
                not verify is refused, never cleared). Needs ``run_id``; excludes ``resume_from``.

        Raises:
            ConfigError: bad ``epochs``/``resume_mode``/``resume`` (a ``resume_mode`` other than ``"stateful"``
                without ``resume_from`` included), an empty train or validation loader, or a run directory in the way.
            ResumeError: the resume point is missing or does not verify, the recipe differs from the run's, or a
                loader has or lacks a generator of its own the run's had (named; nothing is restored or erased).
            LeaseHeldError: another process writes this run (:mod:`nnx_es.lease`).
            UnsafePathError: a path of the run (directory, lease, log, blob, views) is a link, a FIFO, ...; refused first.
            Exception: whatever training raised, after finalization.
        """
        check_fit_args(train_loader, val_loader, epochs=epochs, monitor=self.monitor, resume_mode=resume_mode,
                       resume=resume, resume_from=resume_from, run_id=self.run_id, distributed=self.distributed)
        ensure_logging()
        with data_parallel(self.distributed, self.net, train_loader, "Trainer.fit", val_loader) as (world, module):
            engine = fit_engine(self.engine, world, train_loader)  # an elastic loader's window (elastic mode)
            components = RunComponents(net=self.net, optimizers=self.optimizers, schedulers=self.schedulers,
                                       engine=engine, update_hooks=self.update_hooks, monitor=self.monitor,
                                       callbacks=self.callbacks, loaders={"train": train_loader, "val": val_loader},
                                       world=world)
            if world.distributed and self.run_id is None:  # one id for every rank: the writer's
                self.run_id = world.share(new_run_id())
            if world.distributed:  # every rank runs the same recipe (nnx_es.distributed.alike)
                check_trainer_alike(world, self, self._declare(components, "", None), train_loader, val_loader,
                                    fit_args={"run_id": self.run_id, "epochs": epochs, "resume": resume,
                                              "resume_mode": resume_mode, "resume_from": resume_from,
                                              "resume_at": resume_at},
                                    logged={"library versions": library_versions(), "recipe": self.recipe})
            return self._fit(train_loader, val_loader, epochs=epochs, resume_from=resume_from,
                             resume_mode=resume_mode, resume=resume, resume_at=resume_at, components=components,
                             module=module)

    def _fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, *, epochs: int,
             resume_from: str | Path | None, resume_mode: str, resume: str | None, resume_at: int | str | None,
             components: RunComponents, module: Any) -> RunResult:
        with open_session(runs_root=self.runs_root, run_id=self.run_id, seed=self.seed, resume_from=resume_from,
                          resume_mode=resume_mode, auto=resume == "auto", resume_at=resume_at, epochs=epochs,
                          components=components, world=components.world,
                          declare=lambda run_id, source: self._declare(components, run_id, source)) as session:
            scope = RunScope(self.plan, session, components, module)
            state, self.state, self.ctx, self.rows = scope.state, scope.state, scope.ctx, scope.rows
            state.after_opening = [*components.take_notes(), *opening_events(self.net)]
            self.run_id, self.runs_root, self.run_dir = state.run_id, state.runs_root, state.run_dir
            scope.run(train_loader, val_loader, epochs)
        if not state.world.is_writer:  # every rank returns the writer's run (its records and provenance)
            return state.world.share(None)  # type: ignore[no-any-return]
        projected = scope.finalization.projection  # the log as finalization projected it for the views
        result = result_of(projected[0], state.run_dir, projected[1]) if projected else load_result(state.run_dir)
        return state.world.share(result) if state.world.distributed else result

    # --- validation -----------------------------------------------------------------------

    def validate(self, loader: Iterable[Any]) -> tuple[dict[str, float], int]:
        """Evaluate on ``loader`` in eval mode; return (``val_`` metrics, rows scored).

        With an :class:`~nnx_es.update_hooks.EMA` update hook, the averaged weights are evaluated.
        """
        net = self.engine.orchestrator.averaged_module() or self.net
        on_batch = None
        if self.val_batch_callback is not None:
            cb, ctx = self.val_batch_callback, self.ctx

            def on_batch(**seen: Any) -> None:
                cb(**seen, step_count=ctx.step_count, epoch=ctx.epoch)
        return evaluate(net, loader, self.objective, self.eval_step_fn, self.metrics, gather=self.batch_gather,
                        device=self.device, world=self.state.world if self.state is not None else None,
                        on_batch=on_batch, rows=self.rows.val_batch if self.rows is not None else None)
