"""A run's validation pass: one function of the net, the loader and the objective.

The training loop runs it (each validated epoch, every ``validate_every_steps`` updates, the final
pass) and :meth:`nnx_es.Trainer.validate` runs it on a loader of the user's; neither calls into
the other. What a pass does (spec 000 "Validation"): eval mode, the net's mode restored after;
the averaged weights when an :class:`~nnx_es.update_hooks.EMA` update hook holds them; the
``val_batch_callback`` after each batch; under data parallelism each rank scores its shard and
the sums are agreed once -- :func:`nnx_es.metrics.evaluate` does the scoring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from nnx_es.metrics import evaluate

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from nnx_es.objective import Objective
    from nnx_es.rows.recorder import RowRecorder
    from nnx_es.runtime.context import TrainContext

__all__ = ["Validation"]


@dataclass(frozen=True, eq=False)
class Validation:
    """How a Trainer validates (fixed at its construction, the same for every fit).

    Attributes:
        net: the trained net.
        objective: the loss (its ``val_loss`` and terms).
        step_fn: ``fn(net, batch) -> (outputs, targets, weights | None)`` (the ``eval_step_fn``).
        metrics: the declared metrics.
        averaged: returns the EMA's averaged module, or None (then ``net`` is scored).
        gather: iterate through :func:`nnx_es.data.iterate_batches`.
        device: where batches are moved (None: as they come).
        batch_callback: the ``val_batch_callback`` (None: none).
    """

    net: nn.Module
    objective: Objective
    step_fn: Callable[[nn.Module, Any], tuple[Tensor, Tensor, Tensor | None]]
    metrics: tuple[Any, ...]
    averaged: Callable[[], nn.Module | None]
    gather: bool = True
    device: torch.device | None = None
    batch_callback: Callable[..., Any] | None = None

    def run(self, loader: Iterable[Any], *, world: Any = None, ctx: TrainContext | None = None,
            rows: RowRecorder | None = None) -> tuple[dict[str, float], int]:
        """One pass over ``loader``: (``val_`` metrics, rows scored).

        ``world``: the run's data-parallel world (None: one process). ``ctx``: the run's view, whose
        step count and epoch the ``val_batch_callback`` is given (None, before any fit: 0 and 0).
        ``rows``: record each batch's per-row values in it (the epoch's own pass only).

        Raises:
            ConfigError: see :func:`nnx_es.metrics.evaluate`.
        """
        on_batch: Callable[..., None] | None = None
        if self.batch_callback is not None:
            cb = self.batch_callback

            def tap(**seen: Any) -> None:
                cb(**seen, step_count=ctx.step_count if ctx is not None else 0,
                   epoch=ctx.epoch if ctx is not None else 0)
            on_batch = tap
        return evaluate(self.averaged() or self.net, loader, self.objective, self.step_fn, self.metrics,
                        gather=self.gather, device=self.device, world=world, on_batch=on_batch,
                        rows=partial(rows.add, "val") if rows is not None else None)
