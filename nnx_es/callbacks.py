"""Callbacks: typed no-op hooks dispatched in list order (``on_train_end`` in reverse).

Only hooks a callback overrides are dispatched. A callback with restart-critical
state returns it from :meth:`Callback.state_dict` (msgpack-able builtins); it is
stored in every checkpoint and given back by :meth:`Callback.load_state_dict` on
resume. A callback that writes its own artifact returns its bytes from
:meth:`Callback.checkpoint`; the trainer stores them as a deferred callback
checkpoint after LAST, BEST and phase (spec 000 "Lifecycle order").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nnx_es.errors import ConfigError

if TYPE_CHECKING:
    from events.schema import UpdateCommitted
    from nnx_es.context import TrainContext

__all__ = ["HOOKS", "Callback", "EarlyStopping", "LambdaCallback"]

HOOKS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_end",
    "on_optimizer_update",
    "on_validation_end",
    "on_epoch_end",
    "on_train_end",
)


class Callback:
    """Base class: every hook is a no-op; override the ones you need."""

    @property
    def name(self) -> str:
        """Stable name used in events and checkpoints (default: class name)."""
        return type(self).__name__

    def on_train_begin(self, ctx: TrainContext) -> None:
        """Once, before the first epoch (in list order)."""

    def on_epoch_begin(self, ctx: TrainContext) -> None:
        """Before each epoch's first microbatch."""

    def on_batch_end(self, ctx: TrainContext) -> None:
        """After each microbatch (and its update, when it closed a window)."""

    def on_optimizer_update(self, ctx: TrainContext, receipt: UpdateCommitted) -> None:
        """After each committed optimizer update, before optimizer_update-clock schedulers step."""

    def on_validation_end(self, ctx: TrainContext, metrics: dict[str, float]) -> None:
        """After each validation pass, with its ``val_`` metrics."""

    def on_epoch_end(self, ctx: TrainContext) -> None:
        """After the epoch's monitor decision and scheduler steps, before its commit."""

    def on_train_end(self, ctx: TrainContext) -> None:
        """Finalization, in reverse list order; runs even when training failed."""

    def state_dict(self) -> dict[str, Any] | None:
        """Restart-critical state (msgpack-able), or ``None`` when stateless."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def checkpoint(self, ctx: TrainContext) -> bytes | None:
        """Bytes of a deferred callback checkpoint for this epoch, or ``None``."""
        return None

    @classmethod
    def overrides(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(Callback, hook)


class LambdaCallback(Callback):
    """A callback from plain functions: ``LambdaCallback(on_epoch_end=lambda ctx: ...)``."""

    def __init__(self, name: str = "LambdaCallback", **hooks: Any) -> None:
        unknown = set(hooks) - set(HOOKS)
        if unknown:
            raise ConfigError(f"unknown callback hooks {sorted(unknown)}; known: {HOOKS}")
        self._name = name
        for hook, fn in hooks.items():
            setattr(self, hook, fn)
        self._hooks = set(hooks)

    @property
    def name(self) -> str:
        return self._name

    def has(self, hook: str) -> bool:
        return hook in self._hooks


class EarlyStopping(Callback):
    """Stop training after ``patience`` epochs without improvement of the run's monitor.

    It reads the epoch's one monitor decision (never the metric itself), so it
    agrees with BEST and ReduceLROnPlateau (Keras / Lightning semantics for
    ``patience``; spec 000 Concepts §6.4 for the single decision).

    Args:
        patience: epochs without improvement tolerated (>= 1).
        min_epochs: never stop before this many epochs have completed.
        monitor: optional; when given it must equal the trainer's monitor name.
    """

    def __init__(self, patience: int = 5, *, min_epochs: int = 0, monitor: str | None = None) -> None:
        if patience < 1:
            raise ConfigError(f"EarlyStopping patience must be >= 1, got {patience!r}")
        self.patience = int(patience)
        self.min_epochs = int(min_epochs)
        self.monitor = monitor
        self.bad_epochs = 0
        self.decision_epoch = -1
        self.stopped_epoch: int | None = None

    def on_train_begin(self, ctx: TrainContext) -> None:
        if ctx.monitor is None:
            raise ConfigError("EarlyStopping needs the trainer's monitor (Trainer(monitor=...))")
        if self.monitor is not None and self.monitor != ctx.monitor.name:
            raise ConfigError(
                f"EarlyStopping(monitor={self.monitor!r}) differs from the trainer's monitor "
                f"{ctx.monitor.name!r}; one decision drives every consumer"
            )

    def on_epoch_end(self, ctx: TrainContext) -> None:
        decision = ctx.decision
        if decision is None or decision.epoch != ctx.epoch:
            return
        self.bad_epochs = decision.bad_epochs
        self.decision_epoch = decision.epoch
        if self.bad_epochs >= self.patience and ctx.epoch + 1 >= self.min_epochs:
            self.stopped_epoch = ctx.epoch
            ctx.request_stop("early_stopping", by=self.name)

    def state_dict(self) -> dict[str, Any]:
        return {
            "bad_epochs": self.bad_epochs,
            "decision_epoch": self.decision_epoch,
            "stopped_epoch": self.stopped_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_epochs = int(state["bad_epochs"])
        self.decision_epoch = int(state["decision_epoch"])
        self.stopped_epoch = state["stopped_epoch"]
