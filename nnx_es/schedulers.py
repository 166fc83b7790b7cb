"""Learning-rate schedulers on a clock: ``"epoch"`` (default) or ``"optimizer_update"``.

* epoch clock: stepped once per committed epoch, after the monitor decision
  (a ReduceLROnPlateau is stepped on that decision, see :func:`nnx_es.monitor.step_plateau`);
* optimizer_update clock: stepped exactly once per committed update of its
  optimizer, never per microbatch, masked window or skipped update
  (spec 000 "Lifecycle order").

Both clocks step here (:func:`step_epoch_clock`, :func:`step_update_clock`), each
step recorded as a ``scheduler_stepped`` event.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import ReduceLROnPlateau

from events.schema import MonitorDecided, PlateauState, SchedulerDecl, SchedulerStepped
from nnx_es.errors import ConfigError
from nnx_es.monitor import Monitor, step_plateau

#: torch's default ``ReduceLROnPlateau(threshold=1e-4, threshold_mode="rel")``: accepted and not
#: applied (the monitor's ``min_delta`` decides improvement); any other threshold is refused
PLATEAU_DEFAULT_THRESHOLD = 1e-4

if TYPE_CHECKING:
    from nnx_es.runtime.recording import Recorder

__all__ = ["CLOCKS", "Scheduler", "step_epoch_clock", "step_update_clock", "wrap_schedulers"]

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


def wrap_schedulers(schedulers: Iterable[Any], optimizers: Mapping[str, Optimizer],
                    monitor: Monitor | None) -> list[Scheduler]:
    """Wrap torch schedulers as :class:`Scheduler` (epoch clock), name them uniquely and bind each
    to the name of the optimizer it drives.

    Raises:
        ConfigError: ``schedulers`` is not a list; two explicitly named schedulers share a name;
            a scheduler wraps an optimizer the trainer does not have; a ReduceLROnPlateau without
            a monitor, or whose ``mode`` disagrees with the monitor's (found now, before training).
    """
    if isinstance(schedulers, Scheduler) or not isinstance(schedulers, Iterable):
        raise ConfigError(f"schedulers must be a list, got {schedulers!r}")
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
        owner = [n for n, o in optimizers.items() if o is w.optimizer]
        if not owner:
            raise ConfigError(f"scheduler {w.name!r} wraps an optimizer that is not among the trainer's optimizers")
        w.optimizer_name = owner[0]
        if w.plateau:
            if monitor is None:
                raise ConfigError(f"scheduler {w.name!r} is a ReduceLROnPlateau: it needs Trainer(monitor=...)")
            if w.scheduler.mode != monitor.mode:
                raise ConfigError(
                    f"scheduler {w.name!r} is ReduceLROnPlateau(mode={w.scheduler.mode!r}) but the monitor "
                    f"{monitor.name!r} has mode={monitor.mode!r}: one decision drives both, so give the "
                    f"scheduler mode={monitor.mode!r}"
                )
            threshold, threshold_mode = float(w.scheduler.threshold), w.scheduler.threshold_mode
            torch_default = threshold == PLATEAU_DEFAULT_THRESHOLD and threshold_mode == "rel"
            if not torch_default and not (threshold_mode == "abs" and threshold == monitor.min_delta):
                raise ConfigError(
                    f"scheduler {w.name!r} is ReduceLROnPlateau(threshold={threshold!r}, "
                    f"threshold_mode={threshold_mode!r}), but whether an epoch improved is decided once, by "
                    f"the monitor {monitor.name!r} (min_delta={monitor.min_delta!r}), and the scheduler's own "
                    f"threshold would be ignored: give the margin to Monitor({monitor.name!r}, "
                    f"min_delta=...) and leave the scheduler's threshold at its default"
                )
        out.append(w)
    return out


def step_epoch_clock(schedulers: Sequence[Scheduler], decision: MonitorDecided | None, rec: Recorder, *,
                     epoch: int, step: int) -> None:
    """Step every epoch-clock scheduler once for committed ``epoch`` (a plateau one on ``decision``;
    without a decision it does not step) and record each step."""
    for s in schedulers:
        if s.clock != "epoch":
            continue
        if s.plateau:
            if decision is None:
                continue  # no decision this epoch: a plateau scheduler does not step
            step_plateau(s.scheduler, decision)
        else:
            s.scheduler.step()
        s.steps += 1
        rec.emit(SchedulerStepped(name=s.name, clock=s.clock, epoch=epoch, step=step, steps=s.steps, lrs=s.lrs(),
                                  plateau=s.plateau_state()))


def step_update_clock(schedulers: Sequence[Scheduler], committed: Collection[str], rec: Recorder, *,
                      epoch: int, step: int) -> None:
    """Step every optimizer_update-clock scheduler of an optimizer in ``committed`` once for the
    committed update ``step`` (1-based) and record each step."""
    for s in schedulers:
        if s.clock == "optimizer_update" and s.optimizer_name in committed:
            s.scheduler.step()
            s.steps += 1
            rec.emit(SchedulerStepped(name=s.name, clock=s.clock, epoch=epoch, step=step, steps=s.steps,
                                      lrs=s.lrs()))
