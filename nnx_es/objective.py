"""Objectives: a loss as named, weighted terms, each reduced to a numerator and a denominator.

A microbatch contributes, per term t, ``num_t = sum_i w_i * l_t(i)`` and the
shared denominator ``den = sum_i w_i`` (the count of valid rows, or their
weight sum). The update engine backpropagates ``sum_t weight_t * num_t`` per
microbatch and divides the accumulated gradient by the window's total ``W``,
so the update equals the gradient of the mean over the whole window, whatever
the microbatch sizes and masks (spec 000 §3, "One update").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from nnx_es.errors import ConfigError
from nnx_es.argchecks import as_number

__all__ = ["LossParts", "Objective", "Term", "accuracy"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class Term:
    """One named loss term.

    Args:
        fn: ``fn(outputs, targets) -> losses`` with one loss per row, shape
            ``(B,)`` (trailing dims are summed). A ``torch.nn`` loss module with a
            ``reduction`` attribute is copied with ``reduction="none"``.
        weight: multiplies the term in the total (float).
    """

    def __init__(self, fn: LossFn | nn.Module, weight: float = 1.0) -> None:
        self.sum_fn: LossFn | None = None  # the same loss summed over every row, when one exists
        if isinstance(fn, nn.Module) and hasattr(fn, "reduction"):
            summed = copy.copy(fn)
            summed.reduction = "sum"
            self.sum_fn = summed
            fn = copy.copy(fn)
            fn.reduction = "none"
        if not callable(fn):
            raise ConfigError(f"a loss term must be callable, got {fn!r}")
        self.fn = fn
        value = as_number(weight)
        if not math.isfinite(value):
            raise ConfigError(f"a loss term's weight must be a finite number, got {weight!r}")
        self.weight = value

    def per_row(self, outputs: Tensor, targets: Tensor) -> Tensor:
        losses = self.fn(outputs, targets)
        if not isinstance(losses, Tensor):
            raise ConfigError(f"a loss term must return a tensor of per-row losses, shape (B,), got {losses!r}")
        if losses.dim() > 0 and losses.shape[0] != outputs.shape[0]:
            raise ConfigError(
                f"a loss term returned {losses.shape[0]} losses for a microbatch of {outputs.shape[0]} rows "
                f"(shape {tuple(losses.shape)}); it must return one loss per row, shape (B,)"
            )
        if losses.dim() == 0:
            raise ConfigError(
                "a loss term returned a scalar; it must return one loss per row, shape (B,) "
                "(use reduction='none')"
            )
        if losses.dim() > 1:
            losses = losses.reshape(losses.shape[0], -1).sum(dim=1)
        return losses


class LossParts:
    """What one microbatch contributes: the backward numerator and the bookkeeping.

    total: ``sum_t weight_t * num_t`` (0-dim tensor, grad-carrying).
    den: the denominator (float). terms: per-term numerators (0-dim tensors,
    detached -- except a single term's, which is ``total`` itself; convert with
    ``float`` when needed, which syncs a device).
    """

    __slots__ = ("total", "den", "terms")

    def __init__(self, total: Tensor, den: float, terms: dict[str, Tensor]) -> None:
        self.total = total
        self.den = den
        self.terms = terms


class Objective:
    """A loss of named, weighted terms.

    Args:
        terms: name -> :class:`Term`, a loss callable/module (weight 1), or
            ``(fn, weight)``. A single callable is the term ``"loss"``.
    """

    def __init__(self, terms: Mapping[str, Any] | LossFn | nn.Module) -> None:
        if callable(terms) and not isinstance(terms, Mapping):
            terms = {"loss": terms}
        if not isinstance(terms, Mapping):
            raise ConfigError(f"an objective is a loss callable or {{name: fn or (fn, weight)}}, got {terms!r}")
        if not terms:
            raise ConfigError("an objective needs at least one term, got none")
        self.terms: dict[str, Term] = {}
        for name, spec in terms.items():
            if isinstance(spec, Term):
                self.terms[name] = spec
            elif isinstance(spec, tuple):
                self.terms[name] = Term(spec[0], spec[1])
            else:
                self.terms[name] = Term(spec)
        #: (name, summed loss) of an objective that is one unweighted term with a summed form
        self._single: tuple[str, LossFn] | None = None
        if len(self.terms) == 1:
            name, term = next(iter(self.terms.items()))
            if term.sum_fn is not None and term.weight == 1.0:
                self._single = (name, term.sum_fn)

    def __call__(self, outputs: Tensor, targets: Tensor, weights: Tensor | None = None) -> LossParts:
        """Reduce one microbatch.

        Args:
            outputs: model outputs, shape ``(B, ...)``.
            targets: targets, shape ``(B, ...)``.
            weights: per-row weights or a 0/1 mask, shape ``(B,)``; ``None``: all 1.
        """
        if weights is None and self._single is not None:  # one unweighted term: one fused reduction
            name, sum_fn = self._single
            total = sum_fn(outputs, targets)
            return LossParts(total, float(outputs.shape[0]), {name: total})
        total: Tensor | None = None
        nums: dict[str, Tensor] = {}
        if weights is not None and isinstance(outputs, Tensor) and outputs.requires_grad:
            # masked rows pass no gradient back to the outputs: a non-finite loss on them (a
            # missing target) would otherwise turn the whole gradient into NaN (0 * NaN)
            keep = (weights != 0).reshape(-1, *([1] * (outputs.dim() - 1)))
            outputs = torch.where(keep, outputs, outputs.detach())
        for name, term in self.terms.items():
            if weights is None and term.sum_fn is not None:
                num = term.sum_fn(outputs, targets)  # one fused reduction: the row sum
            else:
                losses = term.per_row(outputs, targets)
                if weights is not None:
                    w = weights.to(losses.dtype)
                    # masked rows contribute exactly 0, even when their loss is not finite
                    losses = torch.where(w != 0, losses * w, torch.zeros_like(losses))
                num = losses.sum()
            nums[name] = num.detach()
            part = num * term.weight if term.weight != 1.0 else num
            total = part if total is None else total + part
        den = float(outputs.shape[0]) if weights is None else float(weights.detach().sum())
        assert total is not None
        return LossParts(total, den, nums)


def accuracy(outputs: Tensor, targets: Tensor, weights: Tensor | None = None) -> tuple[float, float]:
    """Correct predictions and their denominator for a classifier.

    outputs: logits or probabilities, shape ``(B, C)``; targets: class ids, shape ``(B,)`` int64.
    Returns ``(correct weight, total weight)`` (floats).
    """
    hit = (outputs.argmax(dim=-1) == targets).to(torch.float64)
    if weights is None:
        return float(hit.sum()), float(hit.numel())
    w = weights.to(torch.float64)
    return float((hit * w).sum()), float(w.sum())
