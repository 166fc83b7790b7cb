"""Whole-epoch metric sums (training summary and validation) and the validation pass.

Every metric is a ratio of sums over the epoch, so it is the exact mean over
all rows however the epoch was split into microbatches:
``loss = sum(weighted numerators) / sum(denominators)``, one value per loss
term when the objective has several, and ``accuracy`` for a classifier
(outputs ``(B, C)``, integer targets ``(B,)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from nnx_es.data import iterate_batches
from nnx_es.errors import ConfigError
from nnx_es.objective import LossParts, Objective, accuracy

__all__ = ["METRICS", "MetricSums", "evaluate", "validate_metrics"]

#: Metrics a run may declare (beyond the loss, which is always reported).
METRICS = ("accuracy",)


def validate_metrics(metrics: Iterable[str]) -> tuple[str, ...]:
    """Return ``metrics`` as a tuple.

    Raises:
        ConfigError: a name that is not in :data:`METRICS`.
    """
    if isinstance(metrics, str):
        raise ConfigError(f"metrics must be a list of names, got the string {metrics!r} (write [{metrics!r}])")
    out = tuple(metrics)
    unknown = [m for m in out if m not in METRICS]
    if unknown:
        raise ConfigError(f"unknown metrics {unknown}; known: {list(METRICS)} (the loss is always reported)")
    return out


class MetricSums:
    """Running sums of one epoch's loss terms and accuracy."""

    __slots__ = ("num", "den", "terms", "_correct", "scored", "rows", "with_accuracy")

    def __init__(self, metrics: tuple[str, ...] = ()) -> None:
        self.with_accuracy = "accuracy" in metrics
        self.num = 0.0
        self.den = 0.0
        self.terms: dict[str, float] = {}
        self._correct: Tensor | float = 0.0  # a tensor while accumulating: no sync per microbatch
        self.scored = 0.0
        self.rows = 0

    @property
    def correct(self) -> float:
        return float(self._correct)

    def add(self, parts: LossParts, num: float, outputs: Tensor, targets: Tensor, weights: Tensor | None,
            *, rows: int | None = None) -> None:
        """Add one microbatch (``num``: its total numerator as a float; non-finite ones are left out;
        ``rows``: its row count, when the caller has it)."""
        if math.isfinite(num):
            self.num += num
            self.den += parts.den
            if len(parts.terms) > 1:
                for name, v in parts.terms.items():
                    self.terms[name] = self.terms.get(name, 0.0) + float(v)
        if rows is None:
            rows = int(targets.shape[0]) if targets.dim() > 0 else 1
        if self.with_accuracy and outputs.dim() == 2 and targets.dim() == 1:
            if weights is None:
                self._correct = self._correct + (outputs.detach().argmax(dim=-1) == targets).sum()
                self.scored += rows
            else:
                c, s = accuracy(outputs.detach(), targets, weights)
                self._correct = self._correct + c
                self.scored += s
        self.rows += rows

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """``{prefix+"loss", prefix+<term> (several terms only), prefix+"accuracy"}`` as floats."""
        den = self.den
        out = {f"{prefix}loss": self.num / den if den > 0 else math.nan}
        if len(self.terms) > 1:
            out.update({f"{prefix}{k}": v / den if den > 0 else math.nan for k, v in self.terms.items()})
        if self.scored > 0:
            out[f"{prefix}accuracy"] = self.correct / self.scored
        return out


@torch.no_grad()
def evaluate(
    net: nn.Module,
    loader: Iterable[Any],
    objective: Objective,
    step_fn: Callable[[nn.Module, Any], tuple[Tensor, Tensor, Tensor | None]],
    metrics: tuple[str, ...] = (),
    *,
    gather: bool = True,
) -> tuple[dict[str, float], int]:
    """One validation pass in eval mode: (``val_`` metrics, rows scored). The net's mode is restored.

    ``gather``: iterate through :func:`nnx_es.data.iterate_batches` (same batches, gathered).
    """
    was_training = net.training
    net.eval()
    sums = MetricSums(metrics)
    try:
        for batch in iterate_batches(loader, gather=gather):
            outputs, targets, weights = step_fn(net, batch)
            parts = objective(outputs, targets, weights)
            sums.add(parts, float(parts.total), outputs, targets, weights)
    finally:
        net.train(was_training)
    return sums.metrics("val_"), sums.rows
