"""The step receipts of an update (:class:`Receipts`, a part of :class:`nnx_es.engine.UpdateEngine`).

Each committed update emits one ``update_committed`` per optimizer with the step receipt's fields
(spec 003: local / global examples, microbatches, accumulation steps, data-parallel size, collective
bytes), then the ``on_optimizer_update`` callbacks and the ``optimizer_update``-clock schedulers.
A custom ``trainer_step_fn`` reports its updates and microbatches through the same path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from events.schema import MicrobatchDone, UpdateCommitted
from nnx_es.errors import ConfigError
from nnx_es.schedulers import step_update_clock

if TYPE_CHECKING:
    from nnx_es.context import TrainContext

__all__ = ["Receipts"]


class Receipts:
    """The engine's receipt methods; the window's accounting (``w_den``, ``w_global_den``,
    ``w_collective_bytes``) and the run (``state``, ``callbacks``) live on the engine."""

    state: Any

    def _receipt_counts(self) -> dict[str, Any]:
        """The open window's accounting for its receipt: ``local_examples`` (this rank's denominator),
        ``global_examples`` (over the ranks: the seam's ``w_global_den``, else the local one),
        ``data_parallel_size``, ``accumulation_steps`` (configured), ``collective_bytes``."""
        local = self.w_den
        g = self.w_global_den
        return {
            "local_examples": local, "global_examples": local if g is None else g,
            "data_parallel_size": self.state.world.size, "accumulation_steps": self.accumulation,
            "collective_bytes": self.w_collective_bytes,
        }

    def report_update(
        self,
        ctx: TrainContext,
        *,
        loss: float,
        examples: float,
        optimizers: list[str],
        microbatches: int,
        grad_norm: float | None,
        clipped: bool,
    ) -> None:
        """Receipts for an update a custom step committed (see ``TrainContext.report_update``)."""
        unknown = [n for n in optimizers if n not in self.optimizers]
        if unknown:
            raise ConfigError(f"report_update names unknown optimizers {unknown}; known: {list(self.optimizers)}")
        self.record_microbatch(ctx, loss=loss, examples=examples)
        if math.isfinite(loss) and examples > 0:  # the epoch summary holds what the custom step reported
            self.epoch.sums.num += loss * examples
            self.epoch.sums.den += examples
        lrs = {n: [float(g["lr"]) for g in self.optimizers[n].param_groups] for n in optimizers}
        counts = {
            "local_examples": examples, "global_examples": examples, "data_parallel_size": self.state.world.size,
            "accumulation_steps": self.accumulation, "collective_bytes": 0,
        }
        self._commit(ctx, optimizers, loss=loss, counts=counts, microbatches=microbatches,
                     grad_norm=grad_norm, clipped=clipped, lrs=lrs)

    def _commit(
        self,
        ctx: TrainContext,
        names: list[str],
        *,
        loss: float,
        counts: dict[str, Any],
        microbatches: int,
        grad_norm: float | None,
        clipped: bool,
        lrs: dict[str, list[float]],
    ) -> None:
        """Emit the receipts of a committed update; ``counts``: :meth:`_receipt_counts`'s accounting."""
        state = self.state
        rec = state.recorder
        state.outcome.committed_update = True
        step = rec.live.step + 1  # ctx.step_count + 1
        receipts = [
            UpdateCommitted(
                step=step, epoch=ctx.epoch, microbatches=microbatches, loss=loss, grad_norm=grad_norm,
                clipped=clipped, lrs=lrs[n], optimizer=n, precision=self.precision, **counts,
                loss_weights=self.objective.weights() if self.objective.scheduled else {},
            )
            for n in names
        ]
        for r in receipts:
            rec.emit(r)
        self.epoch.updates += 1
        if self._on_update:
            for r in receipts:
                self.callbacks.optimizer_update(ctx, r)
        if self.update_clock:
            step_update_clock(self.update_clock, names, rec, epoch=ctx.epoch, step=step)

    def record_microbatch(self, ctx: TrainContext, *, loss: float | None, examples: float) -> None:
        """Emit ``microbatch_done`` for the current batch of a custom ``trainer_step_fn``, once
        (the default step emits its own in :meth:`microbatch`)."""
        outcome = self.state.outcome
        if outcome.microbatch_recorded:
            return
        outcome.microbatch_recorded = True
        outcome.unreported += 1
        self.epoch.microbatches += 1
        batch = ctx.batch
        rows = len(batch[0]) if isinstance(batch, (tuple, list)) and hasattr(batch[0], "__len__") else 1
        self.state.recorder.emit(MicrobatchDone(
            epoch=ctx.epoch, batch=ctx.batch_index, rows=rows, examples=float(examples),
            loss=float(loss) if loss is not None else math.nan,
        ))
