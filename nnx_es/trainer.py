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

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from events.schema import DigestCadence, RunStarted, SourceRef, UpdateSpec
from nnx_es.argchecks import (check_batch_callback, check_cadences, check_fit_args, check_run_args, monitor_of,
                              optimizers_of)
from nnx_es.batches import weighted_forward
from nnx_es.callbacks import Callback, CallbackList
from nnx_es.commit import checkpoint_lag as lag_in_updates
from nnx_es.declare import describe_objective
from nnx_es.device import place_model, resolve_device
from nnx_es.distributed.alike import check_alike, declaration
from nnx_es.distributed.roles import check_declared, for_rank
from nnx_es.distributed.wrap import check_distributed, data_parallel, is_writer_rank
from nnx_es.errors import ConfigError
from nnx_es.evaluation import weights_fingerprint
from nnx_es.finetune import group_names, initial_weights
from nnx_es.loaders import loader_geometries
from nnx_es.logs import ensure_logging
from nnx_es.metrics import check_accuracy, check_metric_names, check_monitor, evaluate, validate_metrics
from nnx_es.models import Keyed, ModelSet, multi_model_step
from nnx_es.monitor import Monitor
from nnx_es.objective import Objective
from nnx_es.recipes.runspec import record_spec, spec_hash
from nnx_es.recorder import Recorder
from nnx_es.result import RunResult, load_result, result_of
from nnx_es.retention import check_retention
from nnx_es.rows.journal import HistoryJournal
from nnx_es.rows.recorder import RowRecorder
from nnx_es.run_state import RunState
from nnx_es.runtime.context import TrainContext
from nnx_es.runtime.engine import UpdateEngine, default_forward
from nnx_es.runtime.loop import NONFINITE, Cadence, LoopSettings
from nnx_es.runtime.scope import CommitSettings, RunPlan, RunScope
from nnx_es.runtime.steps import default_train_step
from nnx_es.schedulers import wrap_schedulers
from nnx_es.session import library_versions, new_run_id, open_session
from nnx_es.snapshot import RunComponents
from nnx_es.stages import StageDispatcher
from nnx_es.storage import BlobStore, validate_run_id
from nnx_es.update_hooks import UpdateOrchestrator, collect, settings_of
from nnx_es.user_metrics import UserMetric, bind_activation, higher_is_better, metric_names

__all__ = ["Trainer"]


class Trainer:
    """Trains ``net`` and records every lifecycle transition in the run's event log.

    Args:
        net: the model (``nn.Module``); checkpoints hold its ``state_dict``. Or several models,
            ``{"student": s, "teacher": t}`` (:mod:`nnx_es.models`): each trainable one (an optimizer
            holds its parameters) is checkpointed under its name; a frozen one (no optimizer) is put
            in eval mode without gradients and declared once by hash in ``run_started.models``
            (verified on a stateful resume). Such a run needs ``training_fn``.
        optimizer: one optimizer, or ``{name: optimizer}`` for several (they step together).
        loss: the objective: a loss module/callable returning per-row losses (a
            ``torch.nn`` loss is used with ``reduction="none"``; several values per row are
            averaged, as torch's ``reduction="mean"``), ``{name: fn or (fn, weight)}``, or an
            :class:`~nnx_es.objective.Objective`.
        monitor: :class:`~nnx_es.monitor.Monitor` or a metric name (``"val_loss"``;
            mode ``max`` when the name contains ``acc``). One decision per
            validated epoch drives BEST, ReduceLROnPlateau and EarlyStopping.
        metrics: declared metrics besides the loss, reported per epoch for training and
            validation (``"accuracy"``: argmax of ``(B, C)`` outputs against ``(B,)`` class ids, or
            one logit ``(B, 1)`` at probability 0.5 against 0/1 targets; other shapes are refused
            on the first batch, before backward), named callables ``(outputs, targets) -> per-row
            values`` and ``torchmetrics`` metrics, in a list or as ``{name: metric}``: each is exact
            over the epoch's rows and monitorable by name (:mod:`nnx_es.user_metrics`).
        schedulers: torch schedulers (epoch clock) or :class:`~nnx_es.schedulers.Scheduler`.
        callbacks: :class:`~nnx_es.callbacks.Callback` objects, dispatched in list order.
        hooks: stage hooks (``stage``, ``frequency``, ``__call__(ctx, stage)``, see
            :mod:`nnx_es.stages`) and update hooks (:mod:`nnx_es.update_hooks`).
        accumulation: microbatches per optimizer update (shortcut for ``GradientAccumulation``).
        clip_grad_norm: max total gradient L2 norm (shortcut for ``GradientClipping``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (shortcut for ``MixedPrecision``).
        track_grad_norm: record every update's total gradient L2 norm (before clipping) in
            ``update_committed.grad_norm``; clipping always records it. Default off: ``None``.
        sample_weights: declare per-row loss weights: a batch ``(inputs, targets, weights)`` is
            read with ``weights`` of shape ``(B,)``, >= 0 (the loss is the weighted mean; a row
            of weight 0 is masked out). The batch contract (:mod:`nnx_es.batches`): a batch is
            ``(inputs, targets)`` (every row weight 1), ``(inputs, targets, weights)`` only with
            ``sample_weights=True``, or a mapping with keys ``x``, ``y`` and optionally
            ``weight`` (the key declares the weights). An undeclared third element, another
            key, or a negative weight is refused (ConfigError) on the first batch it appears in.
        train_step_fn / eval_step_fn: ``fn(net, batch) -> (outputs, targets, weights|None)``,
            replacing the batch contract with your own reading of a batch.
        trainer_step_fn: ``fn(ctx, batch)`` replacing the whole microbatch+update
            path; it reports its updates with ``ctx.report_update(...)``.
        validate_every: validate every N epochs (and after the last epoch).
        validate_every_steps: also validate every N committed updates (no monitor decision).
        phase_every / keep_phases: a phase checkpoint every N epochs; keep the newest K.
        keep_last / keep_best: checkpoint retention (:mod:`nnx_es.retention`): the checkpoints of
            the newest ``keep_last`` LASTs and BEST's are kept (``keep_last=None``: every one), every
            other one is pruned once the LAST superseding it is durable, each deletion recorded as a
            ``checkpoint_pruned`` event. Default: what a resume and loading BEST need.
        checkpoint_lag: 0 commits each epoch's LAST at its end; N > 0 persists the
            checkpoint on a background thread and appends LAST after N committed
            updates of the next epoch; ``"epoch"``: at the next epoch's end (see
            :mod:`nnx_es.commit`). A crash can then lose up to that much more work.
        runs_root: the directory holding ``<run_id>/`` and ``.leases/``.
        run_id: ``[A-Za-z0-9._-]{1,128}``; default: a timestamp and random suffix.
        seed: seeds Python, numpy and torch before training; under ``distributed=DDP()`` with more
            than one rank, rank ``r`` seeds them with :func:`nnx_es.rng.rank_seed` ``(seed, r)``
            (each rank's own dropout; ``train_loader``'s partition keeps its own seed + epoch).
        progress: show a progress display (default: when stderr is a terminal).
        batch_gather: fetch each batch of a ``DataLoader`` over an in-memory ``TensorDataset``
            with one index per tensor instead of row by row -- the same batches, order and RNG
            draws (see :mod:`nnx_es.data`); ``False`` iterates every loader as given.
        recipe: your run's configuration as JSON-like builtins (data set, hyperparameters, code
            version); stored verbatim in ``run_started`` so ``tools/inspect`` shows what was run.
        recipe_required / spec: record the run's spec (:mod:`nnx_es.recipes`: import paths and
            constructor keywords) in ``run_started``, refusing now, named, what cannot be recovered;
            ``spec``: the ``RunSpec`` this trainer was built from (its data and epochs are recorded).
        sinks: live logging (:mod:`nnx_es.sinks`): ``TensorBoardSink``, ``CsvSink``, ``MlflowSink``, fed the
            committed events on a thread of their own, on the writer rank; a failing sink is warned
            about (``SinkWarning``) and dropped, never failing the run.
        nonfinite: what a non-finite loss, gradient or validation metric does: ``"skip"`` the
            update (the default; a :class:`~nnx_es.errors.NonFiniteWarning` each epoch names how
            many were skipped), ``"stop"`` the run at the first one (the epoch ends there and is
            committed; status ``stopped``, reason ``nonfinite``) or ``"raise"``
            :class:`~nnx_es.errors.NonFiniteError` (status ``failed``; LAST stays at the last
            committed epoch). A run that trains microbatches but commits no update never ends
            ``completed`` (:class:`~nnx_es.errors.NoUpdateError`).
        history: where per-row records go (:mod:`nnx_es.rows`; recorded when the batches carry row
            ids, e.g. ``with_row_ids(dataset)``): ``None`` (default) as ``rows_recorded`` events in the
            log, every epoch's kept in memory (small runs), or a
            :class:`~nnx_es.rows.HistoryJournal` (chunk blobs; memory holds its ``window`` epochs).
            Under ``distributed=DDP()`` the records are global: each epoch's are gathered from every
            rank, every rank sees the union, the writer writes them (:mod:`nnx_es.rows.recorder`).
        device: where to train: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``;
            default: the model's own device. The model (and any optimizer state) is moved there
            now, and every batch's tensors (nested tuples, lists, mappings, dataclasses) before the
            batch's stages, without blocking when the loader pins memory. Checkpoints stay
            device-independent (see :mod:`nnx_es.device`). A device this machine does not have
            is refused now.
        distributed: :class:`nnx_es.distributed.DDP` to train data-parallel inside the process
            group ``torchrun`` started (spec 000 §3): the net is wrapped in
            ``DistributedDataParallel`` for each ``fit`` (never assigned to it; checkpoints hold its
            own keys), each window's denominator and finiteness are agreed in one all-reduce, and
            only ``DDP(writer_rank=)`` writes the run. Refused with it: BatchNorm layers (on GPUs
            convert them with ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; on CPU, where
            ``SyncBatchNorm`` does not run and is refused too, remove them or replace them, e.g. with
            ``GroupNorm`` / ``LayerNorm``), a ``trainer_step_fn``, ``precision="fp16"``. Without it, a process that is one of several
            ranks is refused (every rank would write the same run alone).
        val_batch_callback: called after each validation batch with the keyword-only signature
            ``(*, batch, predictions, loss, batch_count, step_count, epoch)``: the batch (moved to
            the device), its outputs ``(B, ...)``, its mean loss (float), its 0-based index in the
            pass, the committed updates so far and the 0-based epoch (spec 004 "Per-batch
            validation callback"): a tap for per-row predictions or a custom sink.
        final_validation: a validation pass on the final weights once training ends
            (``validation_done`` with ``trigger="final"``, ``on_validation_end``, ``AFTER_VALIDATION``;
            no monitor decision): ``True`` always (with a validation loader), ``"auto"`` (default)
            when the final weights are not the ones last validated (a stop at an update boundary, or
            updates after a step-cadence pass), ``False`` never.
        init_from: the initial weights of a fine-tuning run, loaded now: a
            :class:`~nnx_es.finetune.WeightsFrom` (a run's BEST/LAST or a ``state_dict``, with its
            key policy ``strict``) or a ``state_dict`` (strict); the source and the keys skipped /
            new are recorded in ``run_started.lineage``. A stateful resume restores LAST over them.

        training_fn: several models: ``training_fn(models, batch) -> {key: tensor}`` predictions
            (``models``: every model by name), for training and validation.
        loss_target_assembler: several models: ``fn(loss, predictions, batch, *, workflow, target_keys)
            -> {key: tensor}`` targets (``workflow``: ``"train"`` or ``"validate"``) when they do not come
            from the batch (a teacher's outputs); without it each target key is read from a mapping batch
            or is the ``y`` of ``(x, y)``. Loss terms name their keys (:class:`~nnx_es.models.Keyed`).
        target_keys: the target keys handed to the assembler (default: those the ``Keyed`` terms read).

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
        accumulation: int = 1,
        clip_grad_norm: float | None = None,
        precision: str = "fp32",
        track_grad_norm: bool = False,
        sample_weights: bool = False,
        train_step_fn: Callable[..., Any] | None = None,
        eval_step_fn: Callable[..., Any] | None = None,
        trainer_step_fn: Callable[[TrainContext, Any], Any] | None = None,
        validate_every: int = 1,
        validate_every_steps: int | None = None,
        phase_every: int | None = None,
        keep_phases: int | None = None,
        keep_last: int | None = 1,
        keep_best: bool = True,
        checkpoint_lag: int | str = 0,
        runs_root: str | Path = "runs",
        run_id: str | None = None,
        seed: int = 0,
        progress: bool | None = None,
        batch_gather: bool = True,
        recipe: Mapping[str, Any] | None = None,
        nonfinite: str = "skip",
        sinks: Sequence[Any] = (),
        recipe_required: bool = False,
        spec: Any = None,
        device: str | torch.device | None = None,
        distributed: Any = None,
        val_batch_callback: Callable[..., Any] | None = None,
        final_validation: bool | str = "auto",
        init_from: Any = None,
        training_fn: Callable[..., Any] | None = None,
        loss_target_assembler: Callable[..., Any] | None = None,
        target_keys: Sequence[str] | None = None,
        history: HistoryJournal | None = None,
    ) -> None:
        self.custom_step = trainer_step_fn is not None
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
        #: where the initial weights came from (``init_from``), recorded in ``run_started``
        self.lineage = initial_weights(net, init_from)
        self.device = resolve_device(device, net)
        place_model(net, self.optimizers, self.device)
        if not (isinstance(loss, (Objective, Mapping, nn.Module)) or callable(loss)):
            raise ConfigError(f"loss must be a loss module, a callable, {{name: fn}} or an Objective, got {loss!r}")
        self.objective = loss if isinstance(loss, Objective) else Objective(loss)
        self.val_batch_callback = check_batch_callback(val_batch_callback)
        if final_validation not in (True, False, "auto"):
            raise ConfigError(f"final_validation must be True, False or 'auto', got {final_validation!r}")
        self.final_validation = final_validation
        self.metrics = validate_metrics(metrics)
        check_metric_names(self.objective, self.metrics)
        check_accuracy(self.objective, self.metrics, models=list(net.models) if isinstance(net, ModelSet) else ())
        bind_activation(self.metrics, (t.fn for t in self.objective.terms.values()))
        self.monitor: Monitor | None = monitor_of(monitor, higher_is_better(self.metrics))
        if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
            raise ConfigError(f"callbacks must be a list of Callback, got {callbacks!r}")
        self.schedulers = wrap_schedulers(schedulers, self.optimizers, self.monitor)
        callbacks = CallbackList(callbacks).callbacks  # checked now; listed again per fit
        if self.distributed is not None:
            check_declared(callbacks, history)  # on every rank, before training
        self.callbacks: list[Callback] = for_rank(callbacks, is_writer=self.distributed is None or is_writer_rank(
            self.distributed))
        check_cadences(validate_every=validate_every, validate_every_steps=validate_every_steps,
                       phase_every=phase_every, keep_phases=keep_phases)
        self.cadence = Cadence(validate_every, validate_every_steps)
        self.phase_every, self.keep_phases = phase_every, keep_phases
        check_retention(keep_last, keep_best)
        self.keep_last, self.keep_best = keep_last, keep_best
        if not isinstance(sample_weights, bool):
            raise ConfigError(f"sample_weights must be True or False, got {sample_weights!r}")
        forward = weighted_forward if sample_weights else default_forward
        if isinstance(net, ModelSet):
            if training_fn is None or train_step_fn is not None or eval_step_fn is not None:
                raise ConfigError("a run of several models makes its predictions with training_fn(models, batch) -> "
                                  "{key: tensor} (and its targets with loss_target_assembler); give training_fn, "
                                  "and no train_step_fn / eval_step_fn")
            keys = tuple(dict.fromkeys(t.target for t in self.objective.terms.values() if isinstance(t, Keyed)))
            keys = tuple(target_keys) if target_keys is not None else keys
            train_step_fn = multi_model_step(training_fn, loss_target_assembler, self.objective, keys, "train")
            eval_step_fn = multi_model_step(training_fn, loss_target_assembler, self.objective, keys, "validate")
        elif training_fn is not None or loss_target_assembler is not None:
            raise ConfigError("training_fn / loss_target_assembler drive a run of several models: pass the models as "
                              "{name: module} (for one net, use train_step_fn)")
        self.eval_step_fn = eval_step_fn or forward
        self.trainer_step_fn = trainer_step_fn or default_train_step
        check_run_args(runs_root=runs_root, seed=seed, progress=progress, batch_gather=batch_gather, recipe=recipe)
        self.runs_root = Path(runs_root)
        self.run_id = validate_run_id(run_id) if run_id is not None else None
        self.run_dir: Path | None = None
        self.seed = int(seed)  # a NumPy integer too
        self.progress_enabled = progress
        self.batch_gather = batch_gather
        self.recipe = dict(recipe or {})
        if nonfinite not in NONFINITE:
            raise ConfigError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        if isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable) or not all(
                callable(getattr(s, "write", None)) for s in sinks):
            raise ConfigError(f"sinks must be a list of live logging sinks (TensorBoardSink, CsvSink, MlflowSink or "
                              f"objects with open/write/close), got {sinks!r}")
        self.sinks = list(sinks)
        if self.monitor is not None:
            check_monitor(self.monitor, self.objective, self.metrics)
        if not isinstance(track_grad_norm, bool):
            raise ConfigError(f"track_grad_norm must be True or False, got {track_grad_norm!r}")
        update_hooks, stage_hooks = collect(hooks)
        self.update_hooks, settings = settings_of(update_hooks, accumulation=accumulation,
                                                  clip_grad_norm=clip_grad_norm, precision=precision,
                                                  track_grad_norm=track_grad_norm)
        self.stages = StageDispatcher(stage_hooks)
        self.engine = UpdateEngine(net, self.optimizers, self.objective, settings, train_step_fn=train_step_fn or forward,
                                   stages=self.stages, orchestrator=UpdateOrchestrator(self.update_hooks))
        for h in self.update_hooks:
            h.configure(self.engine)
        self.rows = RowRecorder(self.objective, history)
        self.lag = lag_in_updates(checkpoint_lag)
        self.plan = RunPlan(
            engine=self.engine, schedulers=self.schedulers, monitor=self.monitor, metrics=self.metrics,
            callbacks=self.callbacks, stages=self.stages, rows=self.rows, validate=self.validate,
            loop=LoopSettings(cadence=self.cadence, step_fn=self.trainer_step_fn, custom_step=self.custom_step,
                              batch_gather=batch_gather, nonfinite=nonfinite, device=self.device,
                              final_validation=final_validation),
            commit=CommitSettings(lag=self.lag, phase_every=phase_every, keep_phases=keep_phases, keep_last=keep_last,
                                  keep_best=keep_best),
            progress=progress, digest_every=self.distributed.digest_every if self.distributed is not None else None,
            sinks=self.sinks, trainer=self)
        #: the context of the latest ``fit`` (``None`` before the first)
        self.ctx: TrainContext | None = None
        if (recipe_required or spec is not None) and any(isinstance(m, UserMetric) for m in self.metrics):
            raise ConfigError(f"metrics {[m.name for m in self.metrics if isinstance(m, UserMetric)]} are callables or "
                              "metric objects, which a recorded spec cannot hold yet: declare built-in metric names "
                              "only with recipe_required=True or a spec")
        self.spec = record_spec(
            recipe_required, spec, net=net, optimizers=self.optimizers, objective=self.objective, monitor=self.monitor,
            metrics=metric_names(self.metrics), schedulers=self.schedulers, callbacks=self.callbacks, update_hooks=self.update_hooks,
            hooks=hooks, steps={"train_step_fn": train_step_fn, "eval_step_fn": eval_step_fn,
                                "trainer_step_fn": trainer_step_fn}, seed=self.seed,
            settings=dict(validate_every=validate_every, validate_every_steps=validate_every_steps, phase_every=phase_every,
                          keep_phases=keep_phases, checkpoint_lag=checkpoint_lag, sample_weights=sample_weights,
                          track_grad_norm=track_grad_norm, batch_gather=batch_gather, keep_last=keep_last,
                          keep_best=keep_best, nonfinite=nonfinite))
        #: the run of the latest ``fit`` (``None`` before the first)
        self.state: RunState | None = None

    # --- the latest run's state, for callers and tests -------------------------------------

    @property
    def recorder(self) -> Recorder:
        """The latest run's recorder (raises ``AttributeError`` before the first ``fit``)."""
        if self.state is None:
            raise AttributeError("recorder: this trainer has not opened a run yet (call fit)")
        return self.state.recorder

    @property
    def store(self) -> BlobStore:
        """The latest run's blob store (raises ``AttributeError`` before the first ``fit``)."""
        if self.state is None:
            raise AttributeError("store: this trainer has not opened a run yet (call fit)")
        return self.state.store

    def _declare(self, components: RunComponents, run_id: str, source: SourceRef | None) -> RunStarted:
        """This trainer's ``run_started``: what a stateful resume must declare again."""
        return RunStarted(
            run_id=run_id, seed=self.seed, recipe=self.recipe, library_versions=library_versions(),
            callbacks=[cb.name for cb in self.callbacks], optimizers=list(self.optimizers),
            schedulers=[s.decl() for s in self.schedulers],
            monitor=self.monitor.spec if self.monitor else None, accumulation=self.engine.accumulation,
            update=UpdateSpec(precision=self.engine.precision, clip_grad_norm=self.engine.clip_grad_norm),
            source=source, wall_time_s=time.time(), loaders=loader_geometries(components.loaders),
            spec=self.spec, spec_hash=spec_hash(self.spec), objective=describe_objective(self.objective),
            lineage=self.lineage, param_groups=group_names(self.optimizers),
            models=self.net.declare() if isinstance(self.net, ModelSet) else None,
            world_size=components.world.size, writer_rank=components.world.writer_rank,
            history=repr(self.rows.journal) if self.rows.journal is not None else "none",
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
                manifest hash). ``"fork"`` starts a new run from the whole state -- a
                branch of history, the source never written: weights, optimizers,
                schedulers, RNG streams (the loaders' included) and callback state as a
                stateful resume restores them (the same recipe checks), with its own
                epochs, counters and monitor counting from 0 (its BEST is the best of its
                own epochs); ``source.state`` is ``"full"``. Semantics: spec 004
                "Restart semantics".
            resume_at: with ``"weights_only"`` or ``"fork"``, the source's checkpoint to start
                from: the seq of one of its committed LASTs, or ``"best"`` (default: its latest
                LAST).

            resume: ``"auto"``, the one switch a restart script needs: resume this trainer's
                ``run_id`` statefully when it has a committed LAST, otherwise start it afresh,
                clearing what a run without any committed LAST left (a run that failed before
                training, or was killed before its first LAST). A LAST that does not verify is
                refused, never cleared. Needs ``run_id``; excludes ``resume_from``.

        Raises:
            ConfigError: bad ``epochs``/``resume_mode``/``resume`` (a ``resume_mode`` other than
                ``"stateful"`` without ``resume_from`` included), an empty train or validation
                loader, or a run directory in the way.
            ResumeError: the resume point is missing or does not verify, the recipe
                differs from the run's, or a loader has or lacks a generator of its own
                the run's had (the reason is named; nothing is restored or erased).
            LeaseHeldError: another process writes this run (by this path or another: the run
                directory itself is locked, :mod:`nnx_es.lease`).
            UnsafePathError: the run directory (as ``runs_root/run_id``), its lease file, log, blob
                or view directory, or a blob, is a symbolic link, a FIFO, ...; refused before anything
                is written (or, found later, the run fails naming it).
            Exception: whatever training raised, after finalization.
        """
        check_fit_args(train_loader, val_loader, epochs=epochs, monitor=self.monitor, resume_mode=resume_mode,
                       resume=resume, resume_from=resume_from, run_id=self.run_id, distributed=self.distributed)
        ensure_logging()
        with data_parallel(self.distributed, self.net, train_loader, "Trainer.fit", val_loader) as (world, module):
            components = RunComponents(net=self.net, optimizers=self.optimizers, schedulers=self.schedulers,
                                       engine=self.engine, update_hooks=self.update_hooks, monitor=self.monitor,
                                       callbacks=self.callbacks, loaders={"train": train_loader, "val": val_loader},
                                       world=world)
            if world.distributed and self.run_id is None:  # one id for every rank: the writer's
                self.run_id = world.share(new_run_id())
            if world.distributed:  # every rank runs the same recipe (nnx_es.distributed.alike)
                declared = declaration(
                    self._declare(components, "", None), train_loader, val_loader, net=self.net, optimizers=self.optimizers,
                    objective=self.objective, schedulers=self.schedulers, callbacks=self.callbacks,
                    update_hooks=self.update_hooks,
                    steps={"train_step_fn": self.engine.train_step_fn, "eval_step_fn": self.eval_step_fn,
                           "trainer_step_fn": self.trainer_step_fn, "val_batch_callback": self.val_batch_callback},
                    trainer_settings={
                        "validate_every": self.cadence.every, "validate_every_steps": self.cadence.every_steps,
                        "final_validation": self.final_validation, "nonfinite": self.nonfinite,
                        "checkpoint_lag": self.lag, "phase_every": self.phase_every, "keep_phases": self.keep_phases,
                        "keep_last": self.keep_last, "keep_best": self.keep_best, "metrics": self.metrics,
                        "batch_gather": self.batch_gather, "custom_step": self.custom_step},
                    own_partition=self.distributed is not None and self.distributed.own_partition,
                    fit_args={"run_id": self.run_id, "epochs": epochs, "resume": resume, "resume_mode": resume_mode,
                              "resume_from": resume_from, "resume_at": resume_at})
                check_alike(world, declared, logged={"library versions": library_versions(), "recipe": self.recipe})
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
            state, self.state, self.ctx = scope.state, scope.state, scope.ctx
            self.run_id, self.runs_root, self.run_dir = state.run_id, state.runs_root, state.run_dir
            scope.run(train_loader, val_loader, epochs)
        if not state.world.is_writer:  # every rank returns the writer's run (its records and provenance)
            return state.world.share(None)  # type: ignore[no-any-return]
        if scope.finalization.projection is not None:  # the log as finalization projected it for the views
            projections, n_events = scope.finalization.projection
            result = result_of(projections, state.run_dir, n_events)
        else:
            result = load_result(state.run_dir)
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
                        on_batch=on_batch, rows=self.rows.val_batch)
