"""One ``fit``'s run, built by constructors.

:class:`RunPlan` is what a :class:`~nnx_es.Trainer` fixes once, at construction, for all its
fits: the update engine, the schedulers, the monitor, the callbacks, the stage hooks, the
history journal's settings, the validation pass and the settings of the loop and the commits.
:class:`RunScope` is one fit's run, built from the plan once the session is open: the state
(the session's), the engine (through the data-parallel strategy under DDP), the per-row
records (from the run's committed ones), the step recorder, the hooks' view, the committer,
finalization, the parameter digests and the loop -- each given what it needs when it is built,
nothing bound to it afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nnx_es.callbacks import Callback, CallbackList
from nnx_es.runtime.commit import Committer
from nnx_es.runtime.finalize import Finalization
from nnx_es.progress import Progress
from nnx_es.rows.dataset import carries_row_ids
from nnx_es.rows.recorder import RowRecorder
from nnx_es.runtime.context import TrainContext
from nnx_es.runtime.engine import UpdateEngine
from nnx_es.runtime.loop import LoopSettings, TrainingLoop
from nnx_es.runtime.steps import StepRecorder
from nnx_es.stages import StageDispatcher

if TYPE_CHECKING:
    from nnx_es.monitor import Monitor
    from nnx_es.rows.journal import HistoryJournal
    from nnx_es.schedulers import Scheduler
    from nnx_es.runtime.session import Session
    from nnx_es.runtime.components import RunComponents

__all__ = ["CommitSettings", "RunPlan", "RunScope"]


@dataclass(frozen=True)
class CommitSettings:
    """When and what to commit (the Trainer's arguments of the same names; :class:`~nnx_es.runtime.commit.Committer`)."""

    lag: int = 0
    phase_every: int | None = None
    keep_phases: int | None = None
    keep_last: int | None = 1
    keep_best: bool = True


@dataclass(frozen=True, eq=False)
class RunPlan:
    """What every fit of one Trainer runs with (see the module docstring).

    ``history``: the per-row records' journal (None: records in the log; each fit's
    :class:`~nnx_es.rows.recorder.RowRecorder` is built by its scope).
    ``validate(loader) -> (val_ metrics, rows)``: one validation pass. ``progress``: show a
    progress display (None: when stderr is a terminal). ``digest_every``: under data
    parallelism, compare the ranks' parameters every N updates (None: each epoch's end).
    ``sinks``: live logging sinks (the writer rank's). ``trainer``: shown to hooks as ``ctx.trainer``.
    """

    engine: UpdateEngine
    schedulers: Sequence[Scheduler]
    monitor: Monitor | None
    metrics: tuple[Any, ...]
    callbacks: Sequence[Callback]
    stages: StageDispatcher
    history: HistoryJournal | None
    validate: Callable[[Iterable[Any]], tuple[dict[str, float], int]]
    loop: LoopSettings
    commit: CommitSettings
    progress: bool | None = None
    digest_every: int | None = None
    sinks: Sequence[Any] = ()
    trainer: Any = None


class RunScope:
    """One fit's run (see the module docstring).

    Args:
        plan: the Trainer's plan.
        session: the open session (its state, opening event, first epoch, checkpoints so far).
        components: what this fit's checkpoints hold.
        ddp_module: the ``DistributedDataParallel`` wrapper of this fit (None: one process).
    """

    def __init__(self, plan: RunPlan, session: Session, components: RunComponents, ddp_module: Any = None) -> None:
        from nnx_es.sinks import LiveSinks

        self.session = session
        state = self.state = session.state
        world = state.world
        engine = components.engine  # the plan's, or its elastic deal's (Trainer.fit)
        if ddp_module is not None:
            from nnx_es.runtime.parallel import DataParallel

            engine = engine.under(DataParallel(ddp_module, world))
        rec = state.recorder
        self.callbacks = CallbackList(plan.callbacks)
        self.rows = RowRecorder(engine.objective, plan.history, rec.log, state.store, state.run_id, world=world)
        # training's per-row records: none asked of each microbatch when the train loader's batches cannot carry ids
        train_rows = self.rows if carries_row_ids(components.loaders.get("train")) else None
        self.steps = StepRecorder(engine, rec, self.callbacks, plan.schedulers, metrics=plan.metrics,
                                  rows=train_rows, world_size=world.size)
        self.ctx = TrainContext(state=state, steps=self.steps, net=engine.net, optimizers=engine.optimizers,
                                schedulers=list(plan.schedulers), monitor=plan.monitor, trainer=plan.trainer,
                                row_records=self.rows)
        self.stages, self.monitor, self.schedulers = plan.stages, plan.monitor, plan.schedulers
        self.validate = plan.validate
        self.progress = Progress(plan.progress)
        self.live = LiveSinks(state.run_dir, rec.log, rec.log.next_seq, plan.sinks) \
            if plan.sinks and world.is_writer else None
        c = plan.commit
        self.committer = Committer(state, components, self.callbacks, self.ctx, lag=c.lag, phase_every=c.phase_every,
                                   keep_phases=c.keep_phases, keep_last=c.keep_last, keep_best=c.keep_best,
                                   pointers=session.checkpoints,
                                   on_durable=self.live.collect if self.live is not None else None)
        self.finalization = Finalization(state, self.callbacks, self.committer, plan.stages, self.ctx)
        self.digest = None
        if ddp_module is not None and world.distributed:
            from nnx_es.distributed.digest import ParamDigest

            self.digest = ParamDigest(engine.net, world, plan.digest_every)
        self.loop = TrainingLoop(self, plan.loop)

    def run(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int) -> None:
        """Train the session's epochs up to ``epochs``, then finalize (:class:`~nnx_es.runtime.loop.TrainingLoop`)."""
        try:
            self.loop.run(train_loader, val_loader, epochs, self.session.opening, self.session.start_epoch)
        finally:
            if self.live is not None:
                self.live.close()
