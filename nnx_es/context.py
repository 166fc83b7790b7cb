"""The context every hook, callback and step function receives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from events.schema import Counters, MonitorDecided

if TYPE_CHECKING:
    from torch import Tensor, nn
    from torch.optim import Optimizer

    from nnx_es.monitor import Monitor
    from nnx_es.schedulers import Scheduler
    from nnx_es.trainer import Trainer

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
    monitor decision (``None`` before it is made).
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.epoch = 0
        self.batch: Any = None
        self.batch_index = 0
        self.predictions: Tensor | None = None
        self.targets: Tensor | None = None
        self.loss: float | None = None
        self.rows = 0
        self.validation: dict[str, float] | None = None
        self.decision: MonitorDecided | None = None
        self.stop_requested: str | None = None
        self.stop_at_update_requested = False

    # --- what the run is made of --------------------------------------------------

    @property
    def net(self) -> nn.Module:
        return self.trainer.net

    @property
    def optimizers(self) -> dict[str, Optimizer]:
        return self.trainer.optimizers

    @property
    def schedulers(self) -> list[Scheduler]:
        return self.trainer.schedulers

    @property
    def monitor(self) -> Monitor | None:
        return self.trainer.monitor

    @property
    def run_dir(self) -> Any:
        return self.trainer.run_dir

    # --- counters -----------------------------------------------------------------

    @property
    def counters(self) -> Counters:
        return self.trainer.recorder.counters

    @property
    def batch_count(self) -> int:
        return self.trainer.recorder.live.batch

    @property
    def step_count(self) -> int:
        return self.trainer.recorder.live.step

    @property
    def global_step_count(self) -> int:
        return self.trainer.recorder.live.global_step

    @property
    def epoch_count(self) -> int:
        return self.trainer.recorder.live.epoch

    @property
    def epoch_step_count(self) -> int:
        return self.trainer.recorder.live.epoch_step

    # --- requests -----------------------------------------------------------------

    def request_stop(self, reason: str = "requested", by: str = "") -> None:
        """Stop after this epoch commits (recorded as a stop-requested event)."""
        self.trainer._request_stop(reason, by)

    def stop_at_update(self) -> None:
        """Stop right after the current (or next) committed update; LAST stays at the last committed epoch."""
        self.stop_at_update_requested = True

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
        """
        self.trainer.engine.report_update(
            self,
            loss=loss,
            examples=examples,
            optimizers=[optimizer] if optimizer is not None else list(self.optimizers),
            microbatches=microbatches,
            grad_norm=grad_norm,
            clipped=clipped,
        )
