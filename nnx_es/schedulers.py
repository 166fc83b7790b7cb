"""Learning-rate schedulers on a clock: ``"epoch"`` (default) or ``"optimizer_update"``.

* epoch clock: stepped once per committed epoch, after the monitor decision
  (a ReduceLROnPlateau is stepped on that decision, see :func:`nnx_es.monitor.step_plateau`);
* optimizer_update clock: stepped exactly once per committed update of its
  optimizer, never per microbatch, masked window or skipped update
  (spec 000 "Lifecycle order").
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from events.schema import PlateauState, SchedulerDecl
from nnx_es.errors import ConfigError

__all__ = ["CLOCKS", "Scheduler"]

CLOCKS = ("epoch", "optimizer_update")


class Scheduler:
    """A torch LR scheduler with its clock and a stable name.

    Args:
        scheduler: any ``torch.optim.lr_scheduler`` object (ReduceLROnPlateau included).
        clock: ``"epoch"`` or ``"optimizer_update"``.
        name: stable name in events and checkpoints; default: the class name, lowercased.

    Raises:
        ConfigError: unknown clock, or a ReduceLROnPlateau on the optimizer_update clock.
    """

    def __init__(self, scheduler: Any, clock: str = "epoch", name: str | None = None) -> None:
        if clock not in CLOCKS:
            raise ConfigError(f"scheduler clock must be one of {CLOCKS}, got {clock!r}")
        self.plateau = isinstance(scheduler, ReduceLROnPlateau)
        if self.plateau and clock != "epoch":
            raise ConfigError("ReduceLROnPlateau steps on the epoch's monitor decision: use clock='epoch'")
        if not hasattr(scheduler, "optimizer") or not isinstance(scheduler.optimizer, Optimizer):
            raise ConfigError(f"scheduler must wrap a torch optimizer, got {scheduler!r}")
        self.scheduler = scheduler
        self.clock = clock
        self.named = name is not None
        self.name = name or type(scheduler).__name__.lower()
        self.steps = 0
        self.optimizer_name = ""

    @property
    def optimizer(self) -> Optimizer:
        return self.scheduler.optimizer  # type: ignore[no-any-return]

    def decl(self) -> SchedulerDecl:
        return SchedulerDecl(
            name=self.name,
            clock=self.clock,
            cls=type(self.scheduler).__name__,
            optimizer=self.optimizer_name,
            plateau=self.plateau,
        )

    def lrs(self) -> list[float]:
        """This scheduler's learning rates after its last step (torch's ``get_last_lr``).

        Its own view, not the optimizer's current one: with several schedulers on
        one optimizer, each reports what its step set.
        """
        last = getattr(self.scheduler, "_last_lr", None)
        if last is None:
            return [float(g["lr"]) for g in self.optimizer.param_groups]
        return [float(v) for v in last]

    def plateau_state(self) -> PlateauState | None:
        if not self.plateau:
            return None
        s = self.scheduler
        return PlateauState(best=float(s.best), num_bad_epochs=int(s.num_bad_epochs), cooldown_counter=int(s.cooldown_counter))

    def summary(self) -> dict[str, Any]:
        """The state the audit compares with the scheduler projection (msgpack-able)."""
        p = self.plateau_state()
        return {
            "steps": self.steps,
            "lrs": self.lrs(),
            "plateau": None
            if p is None
            else {"best": p.best, "num_bad_epochs": p.num_bad_epochs, "cooldown_counter": p.cooldown_counter},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])
