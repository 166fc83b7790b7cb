"""Loss-term weights that follow a schedule over committed updates or epochs.

``Objective({"ce": nn.CrossEntropyLoss(), "aux": (aux_loss, LinearWarmup(0.0, 0.5, over=100))})``:
a term's weight may be a :class:`WeightSchedule` instead of a number. A schedule is a pure
function of one clock:

* ``clock="optimizer_update"`` (default): ``t`` = the updates committed so far (``step``,
  0 before the first): every microbatch of the window that makes update ``t + 1`` uses
  ``value(t)``;
* ``clock="epoch"``: ``t`` = the 0-based epoch.

Because the weight is a function of the run's counters, it needs no state of its own: the
counters are in every checkpoint, so a resumed run (stateful, or after SIGKILL) computes the
very weights the uninterrupted run used, bitwise. Each update's weights are recorded in its
receipt (``update_committed.loss_weights``, by term name; only when some weight is
scheduled), a schedule is declared in ``run_started.objective`` (a stateful resume with
another schedule is refused) and is a recipe (``to_spec``: its constructor keywords are its
attributes). Validation scores with the weights of the latest update.

Schedules: :class:`Constant`, :class:`LinearWarmup`, :class:`Cosine`, :class:`StepWeight`.
"""

from __future__ import annotations

import math

from nnx_es.argchecks import as_number
from nnx_es.errors import ConfigError

__all__ = ["CLOCKS", "Constant", "Cosine", "LinearWarmup", "StepWeight", "WeightSchedule"]

#: what a schedule counts
CLOCKS = ("optimizer_update", "epoch")


def _finite(name: str, value: object) -> float:
    v = as_number(value)
    if not math.isfinite(v):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    return v


def _count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class WeightSchedule:
    """A loss-term weight as a function of a clock count ``t`` (see the module docstring)."""

    clock: str = "optimizer_update"

    def _check_clock(self, clock: str) -> str:
        if clock not in CLOCKS:
            raise ConfigError(f"clock must be one of {CLOCKS}, got {clock!r}")
        return clock

    def value(self, t: int) -> float:
        """The weight at clock count ``t`` (>= 0)."""
        raise NotImplementedError

    def at(self, step: int, epoch: int) -> float:
        """The weight for a microbatch after ``step`` committed updates, in 0-based ``epoch``."""
        return self.value(step if self.clock == "optimizer_update" else epoch)

    def describe(self) -> str:
        """A stable description (``run_started.objective``): the class and its settings."""
        items = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()))
        return f"{type(self).__name__}({items})"

    def __repr__(self) -> str:
        return self.describe()


class Constant(WeightSchedule):
    """``value`` at every count."""

    def __init__(self, value: float, clock: str = "optimizer_update") -> None:
        self.value_ = _finite("value", value)
        self.clock = self._check_clock(clock)

    def recipe_kwargs(self) -> dict[str, object]:
        return {"value": self.value_, "clock": self.clock}

    def value(self, t: int) -> float:
        return self.value_


class _Ramp(WeightSchedule):
    """From ``start`` at ``t = 0`` to ``end`` at ``t = over`` along :meth:`_at`, then ``end``."""

    def __init__(self, start: float, end: float, over: int, clock: str = "optimizer_update") -> None:
        self.start, self.end = _finite("start", start), _finite("end", end)
        self.over = _count("over", over, 1)
        self.clock = self._check_clock(clock)

    def value(self, t: int) -> float:
        return self.end if t >= self.over else self._at(t)

    def _at(self, t: int) -> float:  # 0 <= t < over
        raise NotImplementedError


class LinearWarmup(_Ramp):
    """From ``start`` at ``t = 0`` linearly to ``end`` at ``t = over``, then ``end``."""

    def _at(self, t: int) -> float:
        return self.start + (self.end - self.start) * (t / self.over)


class Cosine(_Ramp):
    """Half a cosine from ``start`` at ``t = 0`` to ``end`` at ``t = over``, then ``end``
    (the shape of ``torch.optim.lr_scheduler.CosineAnnealingLR`` without restarts)."""

    def _at(self, t: int) -> float:
        return self.end + (self.start - self.end) * (1.0 + math.cos(math.pi * t / self.over)) / 2.0


class StepWeight(WeightSchedule):
    """``start * gamma ** (t // every)`` (the shape of ``torch.optim.lr_scheduler.StepLR``)."""

    def __init__(self, start: float, gamma: float, every: int, clock: str = "optimizer_update") -> None:
        self.start, self.gamma = _finite("start", start), _finite("gamma", gamma)
        self.every = _count("every", every, 1)
        self.clock = self._check_clock(clock)

    def value(self, t: int) -> float:
        return self.start * self.gamma ** (t // self.every)
