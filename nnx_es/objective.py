"""Objectives: a loss as named, weighted terms, each reduced to a numerator and a denominator.

A microbatch contributes, per term t, ``num_t = sum_i w_i * l_t(i)`` and the
shared denominator ``den = sum_i w_i`` (the count of valid rows, or their
weight sum).

``l_t(i)`` is one number per row. A loss that returns several values per row,
shape ``(B, ...)`` (a 3-output ``MSELoss``, a per-pixel loss), is reduced over its
non-batch dimensions by their **mean**, as torch's own ``reduction="mean"`` does: a
run's loss, and its gradient, equal ``loss_fn(outputs, targets)`` with the default
reduction. A loss returning ``(B,)`` is used as it is. A loss whose output does
not start with the batch dimension, or has more values per row than the outputs
and targets have (a ``(B, B)`` from ``(B,)`` targets broadcast against ``(B, 1)``
outputs), is refused with the shapes named.

Weights (see :mod:`nnx_es.batches`) have shape ``(B,)`` and are finite and >= 0;
the check shares the host sync that reads their sum. The update engine backpropagates ``sum_t weight_t * num_t`` per
microbatch and divides the accumulated gradient by the window's total ``W``,
so the update equals the gradient of the mean over the whole window, whatever
the microbatch sizes and masks (spec 000 §3, "One update").
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np
import torch
from torch import Tensor, nn

from nnx_es.errors import ConfigError
from nnx_es.loss_weights import WeightSchedule
from nnx_es.argchecks import as_number

__all__ = ["LossParts", "Objective", "Term", "accuracy", "accuracy_kind", "hits", "ignored_mask", "row_losses"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class Term:
    """One named loss term.

    Args:
        fn: ``fn(outputs, targets) -> losses`` with one loss per row, shape
            ``(B,)``, or ``(B, ...)``: the trailing dims are reduced by their mean
            (torch's ``reduction="mean"``). Targets equal to the ``ignore_index`` of a
            ``CrossEntropyLoss`` / ``NLLLoss`` (or of a plain function declaring an int
            ``fn.ignore_index``, its losses 0 there) count in no mean. A ``torch.nn`` loss module with a
            ``reduction`` attribute is copied with ``reduction="none"`` (and summed
            over rows with ``reduction="sum"`` when no row is weighted).
        weight: multiplies the term in the total: a float, or a
            :class:`~nnx_es.loss_weights.WeightSchedule` over updates or epochs (its value is set
            before each microbatch by :meth:`Objective.at`).

    Raises:
        ConfigError: ``fn`` is not callable or ``weight`` is not a finite number; when called,
            a loss that is not a tensor, a scalar, does not start with the batch dimension, or
            has more values per row than the outputs and targets (a broadcast; shapes named).
    """

    def __init__(self, fn: LossFn | nn.Module, weight: float = 1.0) -> None:
        self.sum_fn: LossFn | None = None  # the same loss summed over every row, when one exists
        #: targets equal to this count in no mean (``CrossEntropyLoss`` / ``NLLLoss``'s ``ignore_index``), or None
        self.ignore_index: int | None = (int(fn.ignore_index) if isinstance(fn, (nn.CrossEntropyLoss, nn.NLLLoss))
                                         or _declares_ignore_index(fn) else None)
        if isinstance(fn, nn.Module) and hasattr(fn, "reduction"):
            _refuse_own_normaliser(fn)
            summed = copy.copy(fn)
            summed.reduction = "sum"
            self.sum_fn = summed
            fn = copy.copy(fn)
            fn.reduction = "none"
        if not callable(fn):
            raise ConfigError(f"a loss term must be callable, got {fn!r}")
        self.fn = fn
        #: the weight's schedule (None: a constant weight)
        self.schedule: WeightSchedule | None = weight if isinstance(weight, WeightSchedule) else None
        value = self.schedule.at(0, 0) if self.schedule is not None else as_number(weight)
        if not math.isfinite(value):
            raise ConfigError(f"a loss term's weight must be a finite number, got {weight!r}")
        self.weight = value
        #: (outputs shape, targets shape) -> values per row of the unreduced loss (for ``sum_fn``)
        self._row_size: dict[tuple[Any, Any], int] = {}

    #: which of the targets :meth:`ignore_targets` reads (None: all of them; a ``Keyed`` term: its key)
    ignore_targets_key: str | None = None

    def ignore_targets(self, targets: Any) -> Any:
        """The targets this term's ``ignore_index`` is compared with: ``targets`` themselves (a ``Keyed``
        term of a several-model run picks its own from the mapping)."""
        return targets

    def recipe_kwargs(self) -> dict[str, Any]:
        """The constructor keywords (:mod:`nnx_es.recipes`): the loss and the weight or its schedule."""
        return {"fn": self.fn, "weight": self.schedule if self.schedule is not None else self.weight}

    def summed(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """``sum_i l(i)`` (0-dim) through ``sum_fn``: its sum over every value, divided by the values per row.

        The values per row are found once per pair of shapes, by one unreduced call (checked
        like :meth:`per_row`'s), so a microbatch costs one fused reduction.
        """
        assert self.sum_fn is not None
        key = (outputs.shape, targets.shape if type(targets) is Tensor else getattr(targets, "shape", None))
        k = self._row_size[key] if key in self._row_size else None  # (no call: per microbatch)
        if k is None:
            with torch.no_grad():
                losses = self._checked(self.fn(outputs.detach(), targets), outputs, targets)
            if len(self._row_size) > 256:  # shapes that vary batch to batch: keep the cache bounded
                self._row_size.clear()
            k = self._row_size[key] = max(1, losses[0].numel()) if losses.shape[0] else 1
        total = self.sum_fn(outputs, targets)
        return total / k if k != 1 else total

    def per_row(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """One loss per row, shape ``(B,)`` (the mean of a row's values when the loss has several)."""
        losses = self._checked(self.fn(outputs, targets), outputs, targets)
        if losses.dim() > 1:
            losses = losses.reshape(losses.shape[0], -1).mean(dim=1)
        return losses

    @staticmethod
    def _checked(losses: Any, outputs: Tensor, targets: Tensor) -> Tensor:
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
            per_row = losses[0].numel() if losses.shape[0] else 0
            room = max(outputs[0].numel() if outputs.shape[0] else 0,
                       targets[0].numel() if isinstance(targets, Tensor) and targets.dim() > 0 and targets.shape[0] else 0)
            if per_row > room:
                raise ConfigError(
                    f"a loss term returned shape {tuple(losses.shape)} for outputs of shape {tuple(outputs.shape)} and "
                    f"targets of shape {tuple(getattr(targets, 'shape', ()))}: more values per row than outputs and "
                    "targets have, so the targets were broadcast against the outputs; give the targets the outputs' "
                    "shape (e.g. y.view(-1, 1) for one output), or return one loss per row, shape (B,)"
                )
        return losses


class LossParts(msgspec.Struct):
    """What one microbatch contributes: the backward numerator and the bookkeeping (a struct: built
    without a Python call, once per microbatch).

    total: ``sum_t weight_t * num_t`` (0-dim tensor, grad-carrying).
    den: the denominator (float). terms: per-term numerators (0-dim tensors,
    detached -- except a single term's, which is ``total`` itself; convert with
    ``float`` when needed, which syncs a device).
    """

    total: Tensor
    den: float
    terms: dict[str, Tensor]
    #: rows' worth of targets a term's ``ignore_index`` leaves out (0-dim float64 on the targets' device,
    #: unread): the true denominator is ``den - ignored``; None: ``den`` is exact
    ignored: Tensor | None = None

    def exact_den(self) -> float:
        """``den`` less the ignored targets (reads ``ignored`` on the host: one sync when there is one)."""
        return self.den if self.ignored is None else self.den - float(self.ignored)


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
        #: the terms whose weight follows a schedule (empty: every weight is constant)
        self.scheduled: dict[str, Term] = {n: t for n, t in self.terms.items() if t.schedule is not None}
        #: (name, term) of an objective that is one unweighted term with a summed form
        self._single: tuple[str, Term] | None = None
        if len(self.terms) == 1:
            name, term = next(iter(self.terms.items()))
            if term.sum_fn is not None and term.weight == 1.0 and term.schedule is None:
                self._single = (name, term)
        #: the ``ignore_index`` values of the terms that have one (``CrossEntropyLoss``, ``NLLLoss``)
        self.ignore: tuple[int, ...] = tuple(sorted({t.ignore_index for t in self.terms.values()
                                                    if t.ignore_index is not None}))
        ignoring = {n: t for n, t in self.terms.items() if t.ignore_index is not None}
        keys = sorted({str(t.ignore_targets_key) for t in ignoring.values()})
        if len(keys) > 1:  # Keyed terms of several tasks, each with its own targets: one denominator cannot hold both
            warnings.warn(
                f"the objective's terms with an ignore_index read different targets ({', '.join(keys)}); they share "
                "one denominator, the rows, so targets equal to their ignore_index count in it (torch's mean would "
                "leave them out): mask such rows with sample weights, or give the terms the same targets",
                UserWarning, stacklevel=2)
            self.ignore, ignoring = (), {}
        elif len(self.ignore) > 1:  # the same targets: one shared denominator cannot be two terms' means
            named = ", ".join(f"{n!r}: ignore_index={t.ignore_index}" for n, t in ignoring.items())
            raise ConfigError(
                f"the objective's terms ignore different targets ({named}); its terms share one denominator, the "
                "targets no term ignores, which would be neither term's torch mean: give every term the same "
                "ignore_index, or train them as one callable returning per-row losses (B,)"
            )
        #: the term whose targets say which rows are ignored (None: no term ignores any)
        self._ignoring: Term | None = next(iter(ignoring.values()), None)

    def at(self, step: int, epoch: int) -> None:
        """Set each scheduled term's weight for a microbatch after ``step`` committed updates in 0-based ``epoch``."""
        for term in self.scheduled.values():
            term.weight = term.schedule.at(step, epoch)  # type: ignore[union-attr]

    def weights(self) -> dict[str, float]:  # every term's current weight, by name
        return {name: term.weight for name, term in self.terms.items()}

    def __call__(self, outputs: Tensor, targets: Tensor, weights: Tensor | None = None) -> LossParts:
        """Reduce one microbatch.

        Args:
            outputs: model outputs, shape ``(B, ...)``.
            targets: targets, shape ``(B, ...)``.
            weights: per-row weights or a 0/1 mask, shape ``(B,)``, finite and >= 0; ``None``: all 1.

        Raises:
            ConfigError: a loss term's output (see :class:`Term`), or weights of another shape,
                negative or not finite (the row and value named).
        """
        ignore = self.ignore  # class targets a term ignores count in no mean, as in torch's reduction="mean"
        if weights is None and self._single is not None:  # one unweighted term: one fused reduction
            name, term = self._single
            total = term.summed(outputs, targets)
            rows = float(batch_rows(outputs))
            if ignore:
                own = targets if term.ignore_targets_key is None else term.ignore_targets(targets)  # a Keyed term's
                ignored = _ignored_rows(own, ignore)
                if ignored is not None and type(ignored) is float:  # counted on the host: den is exact
                    return LossParts(total, rows - ignored, {name: total})
                return LossParts(total, rows, {name: total}, ignored)
            return LossParts(total, rows, {name: total})
        share = _valid_share(self._ignoring.ignore_targets(targets), ignore) if self._ignoring is not None else None
        total: Tensor | None = None
        nums: dict[str, Tensor] = {}
        rows = batch_rows(outputs)
        ignored = None
        if weights is None:
            den = float(rows)
            if share is not None:
                ignored = rows - share.sum()
        else:
            kept = share is not None and isinstance(weights, Tensor) and tuple(weights.shape) == (rows,)
            den = _weight_sum(weights, rows, share if kept else None)
        if weights is not None and isinstance(outputs, Tensor) and outputs.requires_grad:
            # masked rows pass no gradient back to the outputs: a non-finite loss on them (a
            # missing target) would otherwise turn the whole gradient into NaN (0 * NaN)
            keep = (weights != 0).reshape(-1, *([1] * (outputs.dim() - 1)))
            outputs = torch.where(keep, outputs, outputs.detach())
        for name, term in self.terms.items():
            # a term without the ignore_index counts each row by its targets' valid share, as the mean's denominator does
            masked = share is not None and term.ignore_index is None
            if weights is None and term.sum_fn is not None and not masked:
                num = term.summed(outputs, targets)  # one fused reduction: the row sum
            else:
                losses = term.per_row(outputs, targets)
                if masked:
                    assert share is not None
                    losses = torch.where(share != 0, losses * share.to(losses.dtype), torch.zeros_like(losses))
                if weights is not None:
                    w = weights.to(losses.dtype)
                    # masked rows contribute exactly 0, even when their loss is not finite
                    losses = torch.where(w != 0, losses * w, torch.zeros_like(losses))
                num = losses.sum()
            nums[name] = num.detach()
            part = num * term.weight if term.weight != 1.0 else num
            total = part if total is None else total + part
        assert total is not None
        return LossParts(total, den, nums, ignored)


def _declares_ignore_index(fn: Any) -> bool:
    """A loss function (not a module: only torch's ``CrossEntropyLoss`` / ``NLLLoss`` are read for it) that
    declares an ``ignore_index`` int attribute: per-row losses that are 0 at targets equal to it, which
    count in no mean (e.g. :func:`nnx_es.model`'s inferred classifier loss, ``F.cross_entropy``)."""
    value = getattr(fn, "ignore_index", None)
    return not isinstance(fn, nn.Module) and isinstance(value, int) and not isinstance(value, bool)


def ignored_mask(targets: Any, ignore: tuple[int, ...]) -> Tensor | None:
    """Where class-index targets (integer ``(B,)`` or ``(B, d1, ...)``) equal one of ``ignore`` (bool, the
    targets' shape); None for other targets (probabilities, a mapping, a 0-dim tensor) or no ``ignore``."""
    if not ignore or not isinstance(targets, Tensor) or targets.dim() == 0 or targets.is_floating_point() \
            or targets.dtype == torch.bool:
        return None
    hit = targets == ignore[0]
    for value in ignore[1:]:
        hit = hit | (targets == value)
    return hit


#: count ignored class targets that are on the CPU on the host (NumPy, no torch op: no device to wait
#: for, and about a quarter of the two torch ops' cost); False: every device's way (tests use both)
HOST_COUNT_ON_CPU = True


def _ignored_rows(targets: Any, ignore: tuple[int, ...]) -> Tensor | float | None:
    """Rows' worth of class-index targets equal to an ``ignore_index``: their count for ``(B,)`` targets,
    the count over the values per row for ``(B, d1, ...)``; None for other targets (see :func:`ignored_mask`).

    On an accelerator: a 0-dim tensor, two small ops, unread (the engine reads it with the window).
    Targets on the CPU are counted on the host (:data:`HOST_COUNT_ON_CPU`): a float, exact.
    """
    if type(targets) is Tensor and targets.dtype == torch.int64 and targets.ndim > 0:
        if HOST_COUNT_ON_CPU and targets.device.type == "cpu":
            values = targets.numpy()
            n = 0  # a membership test first: no count for a batch without one (the usual case)
            for v in ignore:
                n += int(np.count_nonzero(values == v)) if v in values else 0
            return float(n) if targets.ndim == 1 else n / (targets[0].numel() or 1)
        if len(ignore) == 1 and targets.ndim == 1:
            return (targets == ignore[0]).sum()  # the common case first: (B,) class ids, one ignore_index
    hit = ignored_mask(targets, ignore)
    if hit is None:
        return None
    if targets.dim() == 1:
        return hit.sum()
    return hit.sum() / (targets[0].numel() or 1)


def _valid_share(targets: Any, ignore: tuple[int, ...]) -> Tensor | None:
    """Each row's share of targets that no term ignores, float64 ``(B,)`` (1.0: none ignored), for class-index
    targets ``(B,)`` or ``(B, d1, ...)`` (integer dtype); None for other targets (probabilities, a mapping).

    Follows torch's ``CrossEntropyLoss`` / ``NLLLoss`` with ``reduction="mean"``: the mean is over the
    targets that are not ``ignore_index``. A row's loss is the mean of its values (ignored ones are 0),
    so counting each row by its valid share makes the window's mean torch's.
    """
    hit = ignored_mask(targets, ignore)
    if hit is None:
        return None
    if targets.dim() == 1:
        return (~hit).to(torch.float64)
    return (~hit).reshape(targets.shape[0], -1).to(torch.float64).mean(dim=1)


def batch_rows(values: Any) -> int:
    """Rows of a microbatch's outputs or targets: a tensor's first dimension, or (a several-model
    run's ``{key: tensor}``) its first tensor's; 1 for a 0-dim tensor or anything else."""
    if type(values) is Tensor or isinstance(values, Tensor):  # first: the one-model case, per microbatch
        return int(values.shape[0]) if values.ndim > 0 else 1
    if isinstance(values, Mapping):
        values = next((v for v in values.values() if isinstance(v, Tensor)), None)
        if isinstance(values, Tensor):
            return int(values.shape[0]) if values.dim() > 0 else 1
    return 1


def row_losses(objective: Objective, outputs: Tensor, targets: Tensor) -> Tensor:
    """Each row's own loss, unweighted: ``sum_t weight_t * l_t(row)``, shape ``(B,)``, no gradient.

    The per-row form of :meth:`Objective.__call__`'s total (rows' sample weights left out):
    what :mod:`nnx_es.rows` records as a row's ``loss``.
    """
    with torch.no_grad():
        total: Tensor | None = None
        for term in objective.terms.values():
            losses = term.per_row(outputs, targets)
            part = losses * term.weight if term.weight != 1.0 else losses
            total = part if total is None else total + part
    assert total is not None
    return total


def _weight_sum(weights: Any, rows: int, share: Tensor | None = None) -> float:
    """``sum(weights)`` (``sum(weights * share)`` with ``share``, float64 ``(B,)``: each row's kept share of
    its targets, see :func:`_valid_share`) as a float, after checking ``weights`` is ``(rows,)``, finite
    and >= 0 -- every weight, an ignored row's too.

    The sum is taken in floating point (integer weights are promoted, never the share truncated to
    their dtype). The sum and the smallest weight come back in one host sync (the one the sum alone needs).
    """
    if not isinstance(weights, Tensor) or tuple(weights.shape) != (rows,):
        got = f"shape {tuple(weights.shape)}" if isinstance(weights, Tensor) else type(weights).__name__
        raise ConfigError(f"per-row weights must be a tensor of shape ({rows},) for a batch of {rows} rows, got {got}")
    if rows == 0:
        return 0.0
    w = weights.detach()
    if not w.is_floating_point():
        w = w.to(torch.float32)
    if share is None:
        total, smallest = torch.stack([w.sum(), w.min()]).tolist()
    else:  # a NaN or inf weight on an ignored row stays non-finite (x 0): refused below
        total, smallest = torch.stack([(w.to(share.dtype) * share).sum(), w.min().to(share.dtype)]).tolist()
    if not (smallest >= 0 and math.isfinite(total)):
        bad = ~(torch.isfinite(w) & (w >= 0))
        row = int(bad.nonzero()[0, 0])
        raise ConfigError(
            f"per-row weights must be finite and >= 0, got weight {float(w[row])!r} at row {row} of the batch; "
            "a weight scales its row's loss in the mean (0 masks the row out): check what the batch's third "
            "element or 'weight' holds"
        )
    return float(total)


def accuracy_kind(outputs: Any, targets: Any) -> str:
    """How accuracy scores these shapes: ``"multiclass"`` or ``"binary"``.

    ``"multiclass"``: outputs ``(B, C)``, C >= 2 (logits or probabilities), targets ``(B,)``
    integer class ids; the prediction is the argmax. ``"binary"``: outputs ``(B, 1)``, one
    logit (``BCEWithLogitsLoss``), targets ``(B,)`` or ``(B, 1)`` of 0/1; the prediction is
    1 when the logit is > 0 (probability > 0.5).

    Raises:
        ConfigError: other shapes (named), saying what to declare instead.
    """
    if isinstance(outputs, Tensor) and isinstance(targets, Tensor) and outputs.dim() == 2:
        rows = outputs.shape[0]
        if outputs.shape[1] >= 2 and tuple(targets.shape) == (rows,) and not targets.is_floating_point():
            return "multiclass"
        if outputs.shape[1] == 1 and tuple(targets.shape) in ((rows,), (rows, 1)):
            return "binary"
    shape = lambda t: tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__  # noqa: E731
    raise ConfigError(
        f"metric 'accuracy' cannot score outputs of shape {shape(outputs)} against targets of shape "
        f"{shape(targets)}: it needs (B, C) outputs with (B,) integer class ids, or one logit (B, 1) with "
        "(B,) or (B, 1) targets of 0/1; for another task leave 'accuracy' out (metrics=())"
    )


def hits(outputs: Tensor, targets: Tensor) -> Tensor:
    """Which rows a classifier gets right: bool, shape ``(B,)`` (see :func:`accuracy_kind`).

    Raises:
        ConfigError: shapes accuracy cannot score.
    """
    if accuracy_kind(outputs, targets) == "multiclass":
        return outputs.argmax(dim=-1) == targets
    return (outputs.reshape(-1) > 0) == (targets.reshape(-1) > 0.5)


def accuracy(outputs: Tensor, targets: Tensor, weights: Tensor | None = None) -> tuple[float, float]:
    """Correct predictions and their denominator for a classifier.

    outputs: logits or probabilities, shape ``(B, C)``, with targets: class ids, shape ``(B,)``
    int64; or one logit ``(B, 1)`` with 0/1 targets ``(B,)`` or ``(B, 1)`` (see :func:`accuracy_kind`).
    Returns ``(correct weight, total weight)`` (floats).

    Raises:
        ConfigError: shapes accuracy cannot score.
    """
    hit = hits(outputs, targets).to(torch.float64)
    if weights is None:
        return float(hit.sum()), float(hit.numel())
    w = weights.to(torch.float64)
    return float((hit * w).sum()), float(w.sum())


def _refuse_own_normaliser(fn: nn.Module) -> None:
    """Refuse a torch loss whose reduction is not the per-row mean the trainer computes: another
    ``reduction`` (``"sum"``, ``"batchmean"``) or class ``weight=`` of ``CrossEntropyLoss``/``NLLLoss``
    (torch's mean then divides by the rows' class weights). Training on it would silently optimise
    another loss than the one given.

    Raises:
        ConfigError: naming the loss and the argument, and what to pass instead.
    """
    name = type(fn).__name__
    if fn.reduction not in ("mean", "none"):  # "none": per-row losses, reduced here by the mean
        raise ConfigError(
            f"{name}(reduction={fn.reduction!r}): the trainer reduces per-row losses by their mean over the "
            f"window's rows (torch's reduction='mean'); pass {name}() with the default reduction, or a "
            "callable returning per-row losses (B,) to reduce your own way"
        )
    if isinstance(fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and getattr(fn, "weight", None) is not None:
        raise ConfigError(
            f"{name}(weight=...): torch's mean over class-weighted rows divides by the sum of the rows' class "
            "weights, which the per-row mean would not: give each row its class weight as a sample weight "
            "(Trainer(sample_weights=True), batches (x, y, w)) and drop weight="
        )
