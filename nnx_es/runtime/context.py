"""The context every hook, callback and step function receives: a view of the run and its requests.

The runtime shows the run here (the loop: the epoch, the batch, the validation metrics, the
decision, the epoch's summary; the engine: the microbatch's outputs, targets and loss, for the
hooks it runs); nothing in the runtime reads a value back from it. A hook's requests go to
whoever owns them: a stop to the run state (:meth:`nnx_es.runtime.run_state.RunState.request_stop`), a
custom step's update to the step recorder (:meth:`nnx_es.runtime.steps.StepRecorder.report_update`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from events.schema import Counters, EpochSummarized, MonitorDecided

if TYPE_CHECKING:
    from torch import Tensor, nn
    from torch.optim import Optimizer

    from nnx_es.monitor import Monitor
    from nnx_es.rows.columns import RowView
    from nnx_es.rows.recorder import RowRecorder
    from nnx_es.runtime.run_state import RunState
    from nnx_es.schedulers import Scheduler

__all__ = ["TrainContext"]


class TrainContext:
    """What a hook can see and ask for.

    Counters (spec 004 "Training counters"): ``batch_count`` microbatches
    completed over the run, ``step_count`` committed updates, ``global_step_count``
    committed updates summed over data-parallel ranks, ``epoch_count`` epochs
    completed, ``epoch_step_count`` microbatches completed in this epoch.

    ``predictions`` / ``targets``: the current microbatch's model outputs
    ``(B, C)`` and targets ``(B,)``; ``loss``: its mean loss (float);
    ``validation``: the latest ``val_`` metrics; ``decision``: the epoch's
    monitor decision (``None`` before it is made). From the epoch's summary on (``on_epoch_end``
    included): ``epoch_summary``, its ``epoch_summarized`` event (rows, microbatches, updates,
    skipped, duration), and ``train_metrics``, the epoch's training metrics (``loss`` is the mean
    over the epoch's rows, where ``ctx.loss`` stays the last microbatch's).

    ``idps``: the per-row records (:mod:`nnx_es.rows`, a :class:`~nnx_es.rows.RowView`): from the
    epoch's close on (``on_epoch_end``) they include that epoch; a callback declaring
    ``history_access = "full"`` sees the run's whole history, the others the window in memory.

    ``trainer``: the :class:`~nnx_es.Trainer` that owns the run, for user code; the
    runtime's own collaborators never reach through it. ``state``: the run in progress
    (:class:`~nnx_es.runtime.run_state.RunState`). ``steps``: the run's step recorder
    (:class:`~nnx_es.runtime.steps.StepRecorder`: what :func:`~nnx_es.default_train_step`,
    :func:`~nnx_es.finalize_step` and :meth:`report_update` drive); ``engine`` its update engine.
    One context per ``fit``, built with the run (:mod:`nnx_es.runtime.scope`).
    """

    def __init__(self, *, state: RunState, steps: Any, net: nn.Module, optimizers: dict[str, Optimizer],
                 schedulers: list[Scheduler], monitor: Monitor | None, trainer: Any = None,
                 row_records: RowRecorder | None = None) -> None:
        self.net = net
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.monitor = monitor
        self.trainer = trainer
        self.state = state
        self.steps = steps
        self.epoch = 0
        self.batch: Any = None
        self.batch_index = 0
        self.predictions: Tensor | None = None
        self.targets: Tensor | None = None
        self._loss: float | None = None
        #: the current microbatch's loss as the engine left it, unread: (its numerator, 0-dim on the
        #: device; its denominator; its rows of ignored targets, 0-dim, or None) -- :attr:`loss` reads it
        self.loss_pending: tuple[Tensor, float, Tensor | None] | None = None
        self.rows = 0
        self.validation: dict[str, float] | None = None
        self.decision: MonitorDecided | None = None
        self.epoch_summary: EpochSummarized | None = None
        self.train_metrics: dict[str, float] = {}
        #: the trainer's per-row records (``None``: a context without them)
        self.row_records = row_records
        #: the hook running belongs to a callback with ``history_access = "full"`` (set by its dispatch)
        self.full_history = False

    @property
    def engine(self) -> Any:
        """The run's update engine (:class:`~nnx_es.runtime.engine.UpdateEngine`)."""
        return self.steps.engine

    @property
    def loss(self) -> float | None:
        """The current microbatch's mean loss (float; ``nan`` when its denominator is 0).

        The engine keeps it on the device until it is read: reading it inside an accumulation
        window costs one host read (a device sync), once; the window's end reads it with the
        rest of the window at no extra cost.
        """
        deferred = self.loss_pending
        if deferred is not None:
            self.loss_pending = None
            total, den, ignored = deferred
            read = self.steps.last_loss if self.steps is not None else None
            if read is not None and read[0] is total:  # read with its window already
                self._loss = read[1]
                return self._loss
            if ignored is None:
                num = total.item()
            else:  # less the rows of ignored targets: read with the loss (one transfer)
                import torch

                num, ignored_rows = torch.stack([total.detach().double(), ignored.double()]).tolist()
                den -= ignored_rows
            self._loss = num / den if den > 0 else math.nan
        return self._loss

    @loss.setter
    def loss(self, value: float | None) -> None:
        self._loss, self.loss_pending = value, None

    def defer_loss(self, total: Tensor, den: float, ignored: Tensor | None = None) -> None:
        """Set :attr:`loss` to ``total / (den - ignored)``, read from ``total`` (0-dim, any device) and
        ``ignored`` (0-dim: rows of ignored targets; None: none) only when asked for."""
        self.loss_pending = (total, den, ignored)

    @property
    def idps(self) -> RowView:
        """The per-row records this hook may see (see the class docstring); empty without row ids."""
        from nnx_es.rows.columns import RowView

        rows = self.row_records
        if rows is None:
            return RowView()
        return rows.full() if self.full_history else rows.window()

    @property
    def run_dir(self) -> Any:
        return self.state.run_dir if self.state is not None else None

    # --- counters -----------------------------------------------------------------

    @property
    def counters(self) -> Counters:
        return self.state.recorder.counters

    @property
    def batch_count(self) -> int:
        return self.state.recorder.live.batch

    @property
    def step_count(self) -> int:
        return self.state.recorder.live.step

    @property
    def global_step_count(self) -> int:
        return self.state.recorder.live.global_step

    @property
    def epoch_count(self) -> int:
        return self.state.recorder.live.epoch

    @property
    def epoch_step_count(self) -> int:
        return self.state.recorder.live.epoch_step

    # --- requests -----------------------------------------------------------------

    @property
    def stop_requested(self) -> str | None:
        """The reason of the stop asked for, or ``None``."""
        stop = self.state.stop_requested if self.state is not None else None
        return stop[0] if stop else None

    @property
    def stop_at_update_requested(self) -> bool:
        return self.state is not None and self.state.stop_at_update_requested

    def request_stop(self, reason: str = "requested", by: str = "") -> None:
        """Stop after this epoch commits (recorded as a stop-requested event)."""
        self.state.request_stop(reason, by)

    def stop_at_update(self) -> None:
        """Stop right after the current (or next) committed update; LAST stays at the last committed epoch.

        Raises:
            ConfigError: under data parallelism (a stop at an update boundary is not agreed between
                the ranks; use :meth:`request_stop`, which is decided once for all at the epoch's end).
        """
        self.state.stop_at_update()

    def report_update(
        self,
        *,
        loss: float,
        examples: float,
        optimizer: str | None = None,
        microbatches: int = 1,
        grad_norm: float | None = None,
        clipped: bool = False,
    ) -> None:
        """Report an optimizer update a custom ``trainer_step_fn`` committed itself.

        Emits the step receipt, dispatches ``on_optimizer_update`` and steps the
        optimizer_update-clock schedulers of that optimizer. A custom step that
        never reports makes those schedulers never step.

        Raises:
            ConfigError: ``optimizer`` is not one of the run's optimizers.
        """
        self.steps.report_update(
            self,
            loss=loss,
            examples=examples,
            optimizers=[optimizer] if optimizer is not None else list(self.optimizers),
            microbatches=microbatches,
            grad_norm=grad_norm,
            clipped=clipped,
        )
