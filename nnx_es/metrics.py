"""Whole-epoch metric sums (training summary and validation) and the validation pass.

Every metric is a ratio of sums over the epoch, so it is the exact mean over
all rows however the epoch was split into microbatches:
``loss = sum(weighted numerators) / sum(denominators)``, one value per loss
term when the objective has several, and ``accuracy`` for a classifier
(outputs ``(B, C)`` with integer targets ``(B,)``, or a binary head: one logit
``(B, 1)`` with 0/1 targets ``(B,)`` or ``(B, 1)``, scored at probability 0.5).

Metrics users bring (named per-row callables, ``torchmetrics`` objects: :mod:`nnx_es.user_metrics`)
are updated with every microbatch of the epoch and computed once at its end, so they too are
exact over the epoch's rows.

A declared metric is never dropped silently: a monitor naming no reported metric is
refused before the run (:func:`check_monitor`), and outputs or targets ``accuracy``
cannot score are refused on the first batch, before its backward pass
(:meth:`MetricSums.check`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from nnx_es.data import iterate_batches
from nnx_es.errors import ConfigError
from nnx_es.monitor import Monitor
from nnx_es.objective import LossParts, Objective, accuracy, accuracy_kind, batch_rows, hits, ignored_mask
from nnx_es.user_metrics import RowMetric, UserMetric, metric_names, split_declared, user_metric

__all__ = ["METRICS", "MetricSums", "check_accuracy", "checked_metrics", "check_metric_names", "check_monitor", "evaluate", "reported_metrics",
           "validate_metrics"]

#: Metrics a run may declare (beyond the loss, which is always reported).
METRICS = ("accuracy",)


def validate_metrics(metrics: Any) -> tuple[Any, ...]:
    """Return ``metrics`` as a tuple of built-in names and :class:`~nnx_es.user_metrics.UserMetric`.

    ``metrics``: a sequence of names (:data:`METRICS`), callables and torchmetrics metrics, or a
    mapping ``{name: callable, metric or built-in name}`` (see :mod:`nnx_es.user_metrics`); a
    built-in sits under its own name (``{"accuracy": "accuracy"}``, as ``["accuracy"]``).

    Raises:
        ConfigError: an unknown name, an object that is no metric, two metrics of one name, or a
            built-in under another key (it is reported under its own name).
    """
    if isinstance(metrics, str):
        raise ConfigError(f"metrics must be a list of names, got the string {metrics!r} (write [{metrics!r}])")
    out: list[Any] = []
    for name, m in split_declared(metrics):
        if isinstance(m, str) and name not in (None, m) and m in METRICS:
            raise ConfigError(f"metrics={{{name!r}: {m!r}}}: the built-in {m!r} is reported under its own name ({m!r} "
                              f"and 'val_{m}'), not renamed: write metrics={{{m!r}: {m!r}}} or [{m!r}]")
        if isinstance(m, str) or (isinstance(m, UserMetric) and name is None):  # a built-in, under its own name
            out.append(m)
        else:
            out.append(user_metric(name, m))
    unknown = [m for m in out if isinstance(m, str) and m not in METRICS]
    if unknown:
        raise ConfigError(f"unknown metrics {unknown}; known: {list(METRICS)} (the loss is always reported), or "
                          "pass a callable (outputs, targets) -> per-row values or a torchmetrics metric")
    names = metric_names(out)
    dup = sorted({n for n in names if names.count(n) > 1 or n == "loss"})
    if dup:
        raise ConfigError(f"metric names must be unique and not 'loss', got {dup} twice (name them: metrics={{name: m}})")
    return tuple(out)


def checked_metrics(objective: Objective, metrics: Any, *, models: Sequence[str] = ()) -> tuple[Any, ...]:
    """``metrics`` validated (:func:`validate_metrics`) and checked against ``objective`` and the run's
    ``models`` (:func:`check_metric_names`, :func:`check_accuracy`): what a trainer checks before anything
    runs, and what ``nnx-es report`` checks of a spec (:func:`nnx_es.recipes.runspec.check_spec_metrics`).

    Raises:
        ConfigError: see the three checks.
    """
    out = validate_metrics(metrics)
    check_metric_names(objective, out)
    check_accuracy(objective, out, models=models)
    return out


def reported_metrics(objective: Objective, metrics: tuple[Any, ...]) -> set[str]:
    """The names of the training metrics a run reports (validation reports the same with ``val_``)."""
    terms = objective.terms if len(objective.terms) > 1 else {}
    return {"loss", *terms, *metric_names(metrics)}


def check_metric_names(objective: Objective, metrics: tuple[Any, ...]) -> None:
    """Refuse a metric named like a loss term the run reports (its value would replace the term's).

    An objective of one term reports it as ``loss`` alone, so its name is free for a metric.

    Raises:
        ConfigError: naming the metrics and the terms they collide with.
    """
    terms = objective.terms if len(objective.terms) > 1 else {}
    clash = sorted(set(metric_names(metrics)) & set(terms))
    if clash:
        raise ConfigError(f"metrics {clash} are named like loss terms of the objective {sorted(terms)}: each is "
                          "reported under its name, so the metric would replace the loss term's value; rename "
                          "the metric (metrics={new_name: m}) or the loss term")


def check_accuracy(objective: Objective, metrics: tuple[Any, ...], *, models: Sequence[str] = ()) -> None:
    """Refuse the built-in ``accuracy`` under a ``BCELoss`` (outputs that are probabilities), or in a
    run of several models, before anything runs.

    ``accuracy`` reads one output per row as a logit (1 when it is > 0); a ``BCELoss`` scores
    probabilities, every one of which is > 0, so the accuracy would be that of always predicting 1.
    A several-model run (``models``: their names, :mod:`nnx_es.models`) steps with predictions and
    targets by key, which ``accuracy`` (one output against one target) cannot score: it was refused
    at the first batch, after the run had begun.

    Raises:
        ConfigError: naming the loss, or the models, and what to use instead.
    """
    if "accuracy" not in [m for m in metrics if isinstance(m, str)]:  # the built-in, not a metric named so
        return
    if models:
        raise ConfigError(
            f"metric 'accuracy' scores one output tensor against one target, but this run trains several models "
            f"{list(models)}, whose step gives predictions and targets by key: leave 'accuracy' out of metrics= "
            "(the loss and each loss term are reported); nothing was trained")
    fns = [t.fn for t in objective.terms.values()]
    if any(isinstance(f, nn.BCELoss) for f in fns) and not any(isinstance(f, nn.BCEWithLogitsLoss) for f in fns):
        raise ConfigError("metric 'accuracy' reads one output as a logit (> 0 predicts 1), but the loss is a BCELoss, "
                          "which scores probabilities (all > 0): end the net with logits and use BCEWithLogitsLoss "
                          "(numerically stabler), or score the probabilities with torchmetrics' BinaryAccuracy "
                          "(metrics={'accuracy': BinaryAccuracy()})")


def check_monitor(monitor: Monitor, objective: Objective, metrics: tuple[str, ...]) -> None:
    """Refuse a monitor that names no metric the run reports, before anything runs.

    Raises:
        ConfigError: naming the monitor and the metrics reported.
    """
    known = reported_metrics(objective, metrics)
    if monitor.name.removeprefix("val_") not in known:
        raise ConfigError(
            f"monitor {monitor.name!r} names no reported metric; this run reports "
            f"{sorted(known)} for training and the same with val_ for validation (declare metrics=[...])"
        )


class MetricSums:
    """Running sums of one epoch's loss terms and accuracy."""

    __slots__ = ("num", "den", "terms", "_correct", "scored", "rows", "with_accuracy", "_checked", "keep_nonfinite",
                 "user", "scores_rows", "_unscored", "ignore")

    def __init__(self, metrics: tuple[Any, ...] = (), *, keep_nonfinite: bool = False) -> None:
        self.with_accuracy = "accuracy" in metric_names(metrics)
        #: this epoch's (or pass's) own, reset state of each user metric
        self.user: list[UserMetric] = [m.fresh() for m in metrics if isinstance(m, UserMetric)]
        #: whether :meth:`add_rows` does more than count rows (accuracy or a user metric scores them)
        self.scores_rows = self.with_accuracy or bool(self.user)
        self.keep_nonfinite = keep_nonfinite
        self.num = 0.0
        self.den = 0.0
        self.terms: dict[str, float] = {}
        self._correct: Tensor | float = 0.0  # a tensor while accumulating: no sync per microbatch
        self.scored = 0.0
        self._unscored: Tensor | float = 0.0  # ignored targets among the scored rows (a tensor: read with the sums)
        #: class targets accuracy leaves out: the objective's ``ignore_index`` values (set by its user)
        self.ignore: tuple[int, ...] = ()
        self.rows = 0
        self._checked: tuple[Any, Any] | None = None  # the shapes check() last accepted

    @property
    def correct(self) -> float:
        return float(self._correct)

    def _settle_scored(self) -> None:
        """Take the ignored targets out of ``scored`` (one read, when there were any)."""
        if isinstance(self._unscored, Tensor):
            self.scored -= float(self._unscored)
            self._unscored = 0.0

    def check(self, outputs: Tensor, targets: Tensor) -> None:
        """Refuse outputs and targets a declared metric cannot score (call before backward).

        Shapes are checked when they change; on the sums' first batch a binary head's targets
        are also checked to be 0/1 (one host sync per epoch).

        Raises:
            ConfigError: see :func:`~nnx_es.objective.accuracy_kind`; or a binary head's
                target that is not 0 or 1 (the value named).
        """
        if not self.with_accuracy:
            return
        shapes = (getattr(outputs, "shape", None), getattr(targets, "shape", None))
        if shapes == self._checked and self.rows:
            return
        if accuracy_kind(outputs, targets) == "binary" and self.rows == 0 and targets.numel():
            bad = (targets != 0) & (targets != 1)
            if bool(bad.any()):
                value = targets.reshape(-1)[bad.reshape(-1)][0].item()
                raise ConfigError(
                    f"metric 'accuracy' on one output logit needs targets of 0/1, got the target {value!r}; "
                    "for a regression with one output leave 'accuracy' out (metrics=())"
                )
        self._checked = shapes

    def add(self, parts: LossParts, num: float, outputs: Tensor, targets: Tensor, weights: Tensor | None,
            *, rows: int | None = None) -> None:
        """Add one microbatch (``num``: its total numerator as a float; ``rows``: its row count,
        when the caller has it)."""
        self.add_loss(num, parts.exact_den(), parts.terms if len(parts.terms) > 1 else None)
        self.add_rows(outputs, targets, weights, rows=rows)

    def add_loss(self, num: float, den: float, terms: dict[str, Any] | None = None) -> None:
        """Add one microbatch's loss: ``num`` its total numerator, ``den`` its denominator, ``terms``
        its per-term numerators (several terms only; floats, or 0-dim tensors read with ``float``).
        A non-finite ``num`` is left out -- training's skipped updates -- unless ``keep_nonfinite``,
        as validation keeps them so that a non-finite batch makes ``val_loss`` non-finite rather
        than vanish."""
        if self.keep_nonfinite or math.isfinite(num):
            self.num += num
            self.den += den
            if terms:
                for name, v in terms.items():
                    self.terms[name] = self.terms.get(name, 0.0) + float(v)

    def add_rows(self, outputs: Tensor, targets: Tensor, weights: Tensor | None, *, rows: int | None = None) -> None:
        """Count one microbatch's rows and score its accuracy (kept as a tensor: no host read
        without weights). Rows whose class target is one of :attr:`ignore` (the loss's
        ``ignore_index``) are left out of accuracy, as the loss leaves them out of its mean."""
        if rows is None:
            rows = batch_rows(targets)
        for m in self.user:
            m.update(outputs, targets, weights)
        if self.with_accuracy:
            skip = ignored_mask(targets, self.ignore) if self.ignore else None
            if weights is None and skip is None:
                self._correct = self._correct + hits(outputs.detach(), targets).sum()
                self.scored += rows
            elif weights is None:  # rows of ignored targets are neither hits nor scored (kept on the device)
                assert skip is not None
                self._correct = self._correct + (hits(outputs.detach(), targets) & ~skip).sum()
                self.scored += rows
                self._unscored = self._unscored + skip.sum()
            else:
                w = weights if skip is None else weights * (~skip).to(weights.dtype)
                c, s = accuracy(outputs.detach(), targets, w)
                self._correct = self._correct + c
                self.scored += s
        self.rows += rows

    def agree(self, world: Any, term_names: Iterable[str] = (), extra: Sequence[float] = ()) -> list[float]:
        """Sum these sums over the ranks of ``world`` (a :class:`~nnx_es.runtime.run_state.World`), in ONE
        all-reduce: afterwards every rank holds the union's sums, so its metrics, records and
        decisions are the same (spec 000 §3 "Records and decisions"). ``term_names``: the
        objective's terms (a rank that scored no batch has none of its own). ``extra``: more values
        to sum in the same all-reduce (float64; e.g. the parameter digest's, deferred); their sums
        are returned. One process: nothing (``extra`` returned as given).
        """
        if not world.distributed:
            return list(extra)
        names = list(term_names)
        if len(names) <= 1:  # one term: the loss itself
            names = []
        self._settle_scored()
        values = [self.num, self.den, self.correct, self.scored, float(self.rows)]
        values += [float(self.terms.get(n, 0.0)) for n in names]
        rows = [m for m in self.user if isinstance(m, RowMetric)]  # a torchmetrics metric syncs in its compute()
        for m in rows:
            values += list(m.sums())
        ours = len(values)
        out = world.agree(torch.tensor(values + list(extra), dtype=torch.float64)).tolist()
        self.num, self.den, self._correct, self.scored, self.rows = out[0], out[1], out[2], out[3], int(out[4])
        if names:
            self.terms = dict(zip(names, out[5:5 + len(names)]))
        at = 5 + len(names)
        for i, m in enumerate(rows):
            m.set_sums(out[at + 2 * i], out[at + 2 * i + 1])
        return out[ours:]

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """``{prefix+"loss", prefix+<term> (several terms only), prefix+"accuracy"}`` as floats."""
        den = self.den
        out = {f"{prefix}loss": self.num / den if den > 0 else math.nan}
        if len(self.terms) > 1:
            out.update({f"{prefix}{k}": v / den if den > 0 else math.nan for k, v in self.terms.items()})
        self._settle_scored()
        if self.scored > 0:
            out[f"{prefix}accuracy"] = self.correct / self.scored
        for m in self.user:
            out[f"{prefix}{m.name}"] = m.compute()
        return out


@torch.no_grad()
def evaluate(
    net: nn.Module,
    loader: Iterable[Any],
    objective: Objective,
    step_fn: Callable[[nn.Module, Any], tuple[Tensor, Tensor, Tensor | None]],
    metrics: tuple[Any, ...] = (),
    *,
    gather: bool = True,
    device: torch.device | None = None,
    world: Any = None,
    on_batch: Callable[..., Any] | None = None,
    rows: Callable[[Any, Tensor, Tensor], None] | None = None,
) -> tuple[dict[str, float], int]:
    """One validation pass in eval mode: (``val_`` metrics, rows scored). The net's mode is restored.

    ``gather``: iterate through :func:`nnx_es.data.iterate_batches` (same batches, gathered);
    ``world``: under data
    parallelism each rank scores its own shard (no collective inside the loop), then the sums
    are agreed once (:meth:`MetricSums.agree`): the metrics are the union's, every row once.
    ``device``: move each batch there first (``None``: as it comes). ``on_batch(*, batch, predictions,
    loss, batch_count)``: called after each batch is scored, with the batch (moved), its outputs,
    its mean loss (float; ``nan`` when no row counts) and its 0-based index in the pass.
    ``rows``: called with each ``(batch, outputs, targets)`` (the per-row records,
    :class:`nnx_es.rows.RowRecorder`).
    Batches follow ``step_fn``'s contract (the default one: :mod:`nnx_es.batches`).

    Raises:
        ConfigError: a batch ``step_fn`` refuses, weights the objective refuses, or outputs and
            targets a declared metric cannot score (:meth:`MetricSums.check`).
    """
    was_training = net.training
    net.eval()
    sums = MetricSums(metrics, keep_nonfinite=True)
    sums.ignore = objective.ignore
    try:
        for index, batch in enumerate(iterate_batches(loader, gather=gather, device=device)):
            outputs, targets, weights = step_fn(net, batch)
            sums.check(outputs, targets)
            parts = objective(outputs, targets, weights)
            num = float(parts.total)
            sums.add(parts, num, outputs, targets, weights)
            if on_batch is not None:
                den = parts.exact_den()
                on_batch(batch=batch, predictions=outputs, loss=num / den if den > 0 else math.nan,
                         batch_count=index)
            if rows is not None:
                rows(batch, outputs, targets)
    finally:
        net.train(was_training)
    if world is not None:
        sums.agree(world, objective.terms)
    return sums.metrics("val_"), sums.rows
