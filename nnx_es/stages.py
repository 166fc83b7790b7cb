"""Training stages and the hooks that run at them (spec 004, "Lifecycle Overview").

A stage hook is any object with ``stage`` (a :class:`TrainingStage`),
``frequency`` (run on every N-th arrival at that stage, N >= 1) and
``__call__(ctx, stage)``. Observation stages may be watched by any number of
hooks; the replacement stages ``DO_BACKWARD`` and ``DO_OPTIMIZER_STEP`` belong
to the update orchestrator (:mod:`nnx_es.update_hooks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from nnx_es.errors import ConfigError

if TYPE_CHECKING:
    from nnx_es.runtime.context import TrainContext

__all__ = ["REPLACEMENT_STAGES", "StageDispatcher", "StageHook", "TrainingStage"]


class TrainingStage(Enum):
    """Where a hook runs, in lifecycle order."""

    BEFORE_TRAINING = "before_training"  #: once, after callbacks began, before the first epoch
    BEFORE_EPOCH = "before_epoch"  #: at each epoch's start
    BEFORE_BATCH = "before_batch"  #: before each microbatch
    BEFORE_FORWARD = "before_forward"  #: the batch is in ``ctx.batch``
    AFTER_FORWARD = "after_forward"  #: ``ctx.predictions`` are available
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"  #: ``ctx.loss`` (microbatch mean) is available
    BEFORE_BACKWARD = "before_backward"
    DO_BACKWARD = "do_backward"  #: replacement stage (update orchestrator)
    AFTER_BACKWARD = "after_backward"  #: gradients are accumulated
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"  #: window end, gradients final
    DO_OPTIMIZER_STEP = "do_optimizer_step"  #: replacement stage (update orchestrator)
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"  #: after a committed update
    AFTER_BATCH = "after_batch"  #: after each microbatch (and its update)
    AFTER_EPOCH = "after_epoch"  #: after the epoch's decision and scheduler steps, before its commit
    AFTER_TRAINING = "after_training"  #: once, after the epoch loop (not after a failure)
    AFTER_VALIDATION = "after_validation"  #: after each validation pass; ``ctx.validation`` is set


REPLACEMENT_STAGES = frozenset({TrainingStage.DO_BACKWARD, TrainingStage.DO_OPTIMIZER_STEP})


@runtime_checkable
class StageHook(Protocol):
    stage: TrainingStage
    frequency: int

    def __call__(self, ctx: TrainContext, stage: TrainingStage) -> Any: ...


class StageDispatcher:
    """Runs stage hooks; a stage without hooks costs one dict lookup.

    Raises:
        ConfigError: a hook without a valid ``stage``/``frequency``, or one that
            declares a replacement stage (those belong to update hooks).
    """

    def __init__(self, hooks: Iterable[Any]) -> None:
        self.by_stage: dict[TrainingStage, list[list[Any]]] = {}
        for hook in hooks:
            stage = getattr(hook, "stage", None)
            if not isinstance(stage, TrainingStage):
                raise ConfigError(f"hook {hook!r} must declare stage = TrainingStage.X, got {stage!r}")
            if stage in REPLACEMENT_STAGES:
                raise ConfigError(
                    f"hook {hook!r} declares {stage.name}: replacement stages are owned by update hooks "
                    "(subclass nnx_es.UpdateHook)"
                )
            freq = getattr(hook, "frequency", 1)
            if not isinstance(freq, int) or freq < 1:
                raise ConfigError(f"hook {hook!r} frequency must be an int >= 1, got {freq!r}")
            self.by_stage.setdefault(stage, []).append([hook, freq, 0])

    def __call__(self, stage: TrainingStage, ctx: TrainContext) -> None:
        entries = self.by_stage.get(stage)
        if entries is None:
            return
        for entry in entries:
            entry[2] += 1
            if entry[2] % entry[1] == 0:
                entry[0](ctx, stage)

    def has(self, stage: TrainingStage) -> bool:
        return stage in self.by_stage
