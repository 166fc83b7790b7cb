"""Metrics users bring: named per-row callables and ``torchmetrics`` metric objects.

``Trainer(metrics=...)`` (and ``NNModel.evaluate(metrics=...)``) takes, beside the built-in
names (``"accuracy"``), a mapping ``{name: metric}`` or a sequence mixing names and metrics:

* a callable ``fn(outputs, targets) -> per-row values``: outputs ``(B, ...)``, targets
  ``(B, ...)`` as the step function returns them; values ``(B,)`` (or ``(B, ...)``, averaged
  per row like a loss). The epoch's value is ``sum(w_i * v_i) / sum(w_i)`` over every row of
  the epoch (``w_i`` the row weights, 1 without ``sample_weights``): the exact mean over the
  rows, however the epoch was cut into batches -- never a mean of batch means. Named by the
  mapping's key, or by the function's ``__name__`` in a sequence (a lambda must be named);
* a ``torchmetrics.Metric`` (optional dependency: ``pip install nnx_es[metrics]``; imported
  lazily, only to recognise one): every microbatch's outputs (detached) and targets go to its
  ``update``, and ``compute()`` at the epoch's end gives the epoch's value over all of its rows
  (F1, AUROC, MAE... computed as torchmetrics computes them on the whole epoch). Each epoch
  and each validation pass works on its own ``clone()``, reset; the object given is never
  updated. With row weights, rows of weight 0 (masked) are left out and any other weight
  than 0 or 1 is refused (torchmetrics metrics take no row weights); named by the mapping's key,
  or by its class name in snake case (``BinaryF1Score`` -> ``binary_f1_score``). Under a
  ``BCEWithLogitsLoss`` (and no ``BCELoss``) logits (one output, or multi-label) are given as
  their sigmoid, and under a ``CrossEntropyLoss`` ``(B, C)`` logits as their softmax
  (:func:`bind_activation`): torchmetrics decides per ``update`` call whether floats are logits
  (any value outside [0, 1]), so a batch of logits that all lie in [0, 1] would otherwise be
  thresholded as probabilities -- a silently wrong F1 or AUROC.

The names are reported as ``<name>`` (training) and ``val_<name>`` (validation), are
monitorable (``monitor="val_binary_f1_score"``: a torchmetrics metric's ``higher_is_better``
sets the monitor's mode; a callable may carry the same attribute), and go to the history.

Data parallelism: a per-row callable's sums join the epoch's one agreement (``MetricSums.agree``);
a torchmetrics metric syncs its states over the default process group in ``compute()``.

Resume: a metric's running state is not checkpointed. It does not need to be: LAST is
committed at epoch boundaries only, so a resumed run restarts the epoch it was in and every
metric starts that epoch from its reset state, exactly as the uninterrupted run did.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from nnx_es.errors import ConfigError

__all__ = ["RowMetric", "TorchMetric", "UserMetric", "bind_activation", "check_recordable", "higher_is_better", "is_torchmetric",
           "metric_names", "split_declared", "user_metric"]


def is_torchmetric(obj: Any) -> bool:
    """Whether ``obj`` is a ``torchmetrics.Metric`` (False when torchmetrics is not even imported)."""
    tm = sys.modules.get("torchmetrics")
    return tm is not None and isinstance(obj, tm.Metric)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class UserMetric:
    """One epoch's (or validation pass's) running state of a user metric: ``update`` per
    microbatch, ``compute`` once at the end. :meth:`fresh` gives a new, reset one."""

    name: str
    #: True / False when larger / smaller values are better; None: not said
    higher_is_better: bool | None = None

    def fresh(self) -> UserMetric:
        raise NotImplementedError

    def update(self, outputs: Tensor, targets: Tensor, weights: Tensor | None) -> None:
        raise NotImplementedError

    def compute(self) -> float:
        raise NotImplementedError


class RowMetric(UserMetric):
    """``fn(outputs, targets) -> per-row values``, averaged exactly over the rows (weighted).

    The sums stay tensors on the outputs' device while the epoch runs (no host read per
    microbatch); :meth:`compute` reads them once.

    Raises:
        ConfigError: from :meth:`update`, values that are not a tensor with one value (or one
            row of values) per row of the batch (the name, the shapes named).
    """

    def __init__(self, name: str, fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.name, self.fn = name, fn
        hib = getattr(fn, "higher_is_better", None)
        self.higher_is_better = hib if isinstance(hib, bool) else None
        self._sum: Tensor | float = 0.0
        self._count: Tensor | float = 0.0

    def fresh(self) -> RowMetric:
        return RowMetric(self.name, self.fn)

    def update(self, outputs: Tensor, targets: Tensor, weights: Tensor | None) -> None:
        values = self.fn(outputs, targets)
        rows = outputs.shape[0] if outputs.dim() > 0 else 1
        if not isinstance(values, Tensor) or values.dim() == 0 or values.shape[0] != rows:
            got = f"shape {tuple(values.shape)}" if isinstance(values, Tensor) else type(values).__name__
            raise ConfigError(f"metric {self.name!r} must return one value per row, a tensor of shape ({rows},) or "
                              f"({rows}, ...) for a batch of {rows} rows, got {got} (return per-row values, not "
                              "their mean: the epoch's mean is taken over all of its rows)")
        values = values.detach().to(torch.float64)
        if values.dim() > 1:
            values = values.reshape(rows, -1).mean(dim=1)
        if weights is None:
            self._sum = self._sum + values.sum()
            self._count = self._count + rows
        else:
            w = weights.detach().to(torch.float64)
            self._sum = self._sum + torch.where(w != 0, values * w, torch.zeros_like(values)).sum()
            self._count = self._count + w.sum()

    def sums(self) -> tuple[float, float]:
        """``(sum of weighted values, sum of weights)`` so far (one host read each)."""
        return float(self._sum), float(self._count)

    def set_sums(self, total: float, count: float) -> None:
        """Replace the sums (data parallelism: the union's, agreed by ``MetricSums.agree``)."""
        self._sum, self._count = total, count

    def compute(self) -> float:
        count = float(self._count)
        return float(self._sum) / count if count > 0 else float("nan")


class TorchMetric(UserMetric):
    """A ``torchmetrics.Metric`` fed every microbatch, computed once per epoch (see the module docstring)."""

    def __init__(self, name: str, metric: Any, *, _template: bool = True) -> None:
        self.name = name
        self.metric = metric.clone() if _template else metric
        if _template:
            self.metric.reset()
        hib = getattr(metric, "higher_is_better", None)
        self.higher_is_better = hib if isinstance(hib, bool) else None
        self._template = metric
        self._placed = False
        self._seen = False
        #: ``"sigmoid"`` / ``"softmax"``: the outputs are logits, given to the metric as probabilities
        #: (:func:`bind_activation`); ``None``: given as they are
        self.activation: str | None = None

    def fresh(self) -> TorchMetric:
        out = TorchMetric(self.name, self._template)
        out.activation = self.activation
        return out

    def update(self, outputs: Tensor, targets: Tensor, weights: Tensor | None) -> None:
        if not self._placed:
            self.metric.to(outputs.device)
            self._placed = True
        outputs = outputs.detach()
        if weights is not None:
            w = weights.detach()
            if bool(((w != 0) & (w != 1)).any()):
                bad = w[(w != 0) & (w != 1)][0].item()
                raise ConfigError(f"metric {self.name!r} (a torchmetrics metric) takes no row weights: only weights "
                                  f"0 (masked out) or 1 can be scored, got the weight {bad!r}; use a per-row "
                                  "callable metric for a weighted mean")
            keep = w != 0
            outputs, targets = outputs[keep], targets[keep]
        if self.activation == "sigmoid" and outputs.is_floating_point():  # elementwise logits (multi-label too)
            outputs = torch.sigmoid(outputs)
        elif self.activation == "softmax" and outputs.is_floating_point() and outputs.dim() == 2 \
                and outputs.shape[1] >= 2:
            outputs = torch.softmax(outputs, dim=1)
        if outputs.shape[0]:
            self.metric.update(outputs, targets)
            self._seen = True

    def compute(self) -> float:
        import torch.distributed as dist

        # under data parallelism torchmetrics syncs the ranks' states inside compute(): every rank
        # must call it, one without rows too
        if not self._seen and not (dist.is_available() and dist.is_initialized()):
            return float("nan")
        value = self.metric.compute()
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ConfigError(f"metric {self.name!r} computes {tuple(value.shape)} values, not one: configure it to "
                              "reduce to a scalar (e.g. average='macro')")
        return float(value)


def bind_activation(metrics: Iterable[Any], loss_fns: Iterable[Any]) -> None:
    """Tell each torchmetrics metric of ``metrics`` whether the outputs are logits, from the loss terms' functions.

    ``BCEWithLogitsLoss`` (alone of the two cross-entropies, without a ``BCELoss``): elementwise
    logits (one output, or multi-label ``(B, C)``), given as their sigmoid; ``CrossEntropyLoss``
    alone: ``(B, C)`` logits, given as their softmax; otherwise as they are.
    """
    from torch import nn

    fns = list(loss_fns)
    logits = any(isinstance(f, nn.BCEWithLogitsLoss) for f in fns)
    ce = any(isinstance(f, nn.CrossEntropyLoss) for f in fns)
    activation: str | None = None  # several kinds of outputs (or probabilities): given as they are
    if logits and not ce and not any(isinstance(f, nn.BCELoss) for f in fns):
        activation = "sigmoid"
    elif ce and not logits:
        activation = "softmax"
    for m in metrics:
        if isinstance(m, TorchMetric):
            m.activation = activation


def user_metric(name: str | None, obj: Any) -> UserMetric:
    """``obj`` (a callable or a torchmetrics metric) as a :class:`UserMetric` named ``name`` (or its own name).

    Raises:
        ConfigError: neither a callable nor a metric, a lambda without a name, or a bad name.
    """
    if is_torchmetric(obj):
        return TorchMetric(name or _snake(type(obj).__name__), obj)
    if not callable(obj):
        raise ConfigError(f"a metric is a name ('accuracy'), a callable (outputs, targets) -> per-row values, or a "
                          f"torchmetrics metric, got {obj!r}")
    if name is None:
        name = getattr(obj, "__name__", None)
        if not name or name == "<lambda>":
            raise ConfigError(f"metric {obj!r} has no name: pass metrics={{'name': fn}}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(f"a metric's name is an identifier, got {name!r}")
    return RowMetric(name, obj)


def check_recordable(metrics: Iterable[Any], *, recorded: bool) -> None:
    """Refuse user metrics (callables, metric objects) in a run whose spec is ``recorded``.

    Raises:
        ConfigError: naming the user metrics, when ``recorded`` and there are any.
    """
    users = [m.name for m in metrics if isinstance(m, UserMetric)]
    if recorded and users:
        raise ConfigError(f"metrics {users} are callables or metric objects, which a recorded spec cannot hold yet: "
                          "declare built-in metric names only with recipe_required=True or a spec")


def metric_names(metrics: Iterable[Any]) -> list[str]:
    """The names of declared metrics (built-in names and :class:`UserMetric` objects)."""
    return [m if isinstance(m, str) else m.name for m in metrics]


def higher_is_better(metrics: Iterable[Any]) -> dict[str, bool]:
    """Name -> whether larger is better, for the user metrics that say so."""
    return {m.name: m.higher_is_better for m in metrics
            if isinstance(m, UserMetric) and m.higher_is_better is not None}


def split_declared(metrics: Mapping[str, Any] | Iterable[Any]) -> list[tuple[str | None, Any]]:
    """``metrics=`` as ``(name or None, object)`` pairs (a mapping's keys name its values)."""
    if isinstance(metrics, Mapping):
        return [(k, v) for k, v in metrics.items()]
    return [(None, m) for m in metrics]
