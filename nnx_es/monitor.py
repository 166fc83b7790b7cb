"""One monitor decision per epoch, and the plateau scheduler driven by it.

The decision (spec 000 "Lifecycle order"; Concepts §6.4) is made once per
validated epoch, before any scheduler steps, and is the only input of BEST,
EarlyStopping and ReduceLROnPlateau on the same monitor, so they cannot
disagree. Improvement: ``value < best - min_delta`` (mode ``min``) or
``value > best + min_delta`` (mode ``max``); a non-finite value never improves.
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim.lr_scheduler import ReduceLROnPlateau

from events.schema import MonitorDecided, MonitorSpec
from nnx_es.errors import ConfigError

__all__ = ["Monitor", "improves", "step_plateau"]


def improves(value: float, best: float, mode: str, min_delta: float) -> bool:
    """Whether monitor ``value`` improves on ``best`` by more than ``min_delta`` in ``mode`` (``"min"``:
    lower is better; ``"max"``: higher); a value that is not finite never improves. The rule the
    monitor decides by and the audit checks its decisions against (spec 000 "Monitor")."""
    if not math.isfinite(value):
        return False
    if mode == "min":
        return value < best - min_delta
    return value > best + min_delta


class Monitor:
    """A named quantity to watch (``"val_loss"``, ``"val_accuracy"``, ``"loss"``...).

    Args:
        name: a key of the epoch's metrics (train metrics, or ``val_``-prefixed validation ones).
        mode: ``"min"`` or ``"max"``.
        min_delta: the smallest change that counts as an improvement (absolute, >= 0).

    Raises:
        ConfigError: bad mode or negative min_delta.
    """

    def __init__(self, name: str, mode: str = "min", min_delta: float = 0.0) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"monitor name must be a metric's name (e.g. 'val_loss'), got {name!r}")
        if mode not in ("min", "max"):
            raise ConfigError(f"monitor mode must be 'min' or 'max', got {mode!r}")
        if not (min_delta >= 0.0):
            raise ConfigError(f"monitor min_delta must be >= 0, got {min_delta!r}")
        self.name = name
        self.mode = mode
        self.min_delta = float(min_delta)
        self.best = math.inf if mode == "min" else -math.inf
        self.best_epoch = -1
        self.bad_epochs = 0

    @property
    def spec(self) -> MonitorSpec:
        return MonitorSpec(name=self.name, mode=self.mode, min_delta=self.min_delta)

    def improves(self, value: float) -> bool:
        return improves(value, self.best, self.mode, self.min_delta)

    def decide(self, epoch: int, value: float) -> MonitorDecided:
        """Make the epoch's decision and update the monitor's state."""
        improved = self.improves(value)
        if improved:
            self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
        else:
            self.bad_epochs += 1
        return MonitorDecided(
            epoch=epoch,
            monitor=self.name,
            mode=self.mode,
            value=value,
            improved=improved,
            best=self.best,
            best_epoch=self.best_epoch,
            bad_epochs=self.bad_epochs,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.bad_epochs = int(state["bad_epochs"])


def step_plateau(sched: ReduceLROnPlateau, decision: MonitorDecided) -> None:
    """Step a ReduceLROnPlateau on the monitor's decision rather than on its own comparison.

    The scheduler's patience, cooldown, factor and min_lr apply as in torch;
    whether the epoch improved is the decision's. Its ``best`` becomes the
    monitor's best.
    """
    if sched.mode != decision.mode:
        raise ConfigError(
            f"ReduceLROnPlateau(mode={sched.mode!r}) disagrees with monitor {decision.monitor!r} "
            f"(mode={decision.mode!r})"
        )
    worse = sched.mode_worse
    # a value the scheduler's own comparison ranks exactly as the decision did
    sched.step(-worse if decision.improved else worse)
    sched.best = decision.best
