"""The checks of :func:`nnx_es.diagnose` and their thresholds, over what it read of a run (:class:`RunRecord`).

The checks and their thresholds (:class:`Thresholds`; each finding names the one it crossed):

* ``nonfinite_updates``: any update skipped because a loss or gradient was not finite
  (the engine's ``update_skipped`` with reason ``nonfinite``; ``Trainer(nonfinite="skip")``).
* ``exploding_gradients``: the total gradient L2 norm of an update reaches ``exploding_factor``
  (10x) times the first measured update's -- the norm "spikes" of Pascanu, Mikolov & Bengio
  (2013), "On the difficulty of training recurrent neural networks". Measured here on the
  digits MLP (10 epochs, every update): healthy runs (Adam 3e-3..3e-2, SGD 0.1..1) peak at
  2.3-5.8x, too high rates (SGD 5, Adam 0.1) at 19-24x.
* ``loss_diverged``: the median training loss of ``diverge_window`` (5) consecutive committed updates
  reaches ``diverge_factor`` (4) times the first update's loss (the loss of the initial weights): the
  divergence rule of the learning-rate range test (Smith 2017; fastai's and Lightning's
  ``early_stop_threshold`` of 4), held against where the run started, so a healthy run's noise
  around a low loss never reaches it. A run that diverged has weights so large that their updates
  look small: ``update_ratio_low`` is not said of it (raising the rate would be the wrong advice).
* ``vanishing_gradients``: a layer whose gradient norm is below ``vanishing_ratio`` (1e-3) times
  the largest layer's (the median over the run's second half): the layer-wise decay Glorot &
  Bengio (2010), "Understanding the difficulty of training deep feedforward neural networks",
  show for saturating networks; a layer behind dead ReLUs gets none at all.
* ``dead_units``: a ReLU-family module whose fraction of dead units (median over the run's
  second half) is at least ``dead_fraction`` (0.4): CS231n "Neural Networks Part 1" warns that
  "as much as 40% of your network can be dead" after too high a learning rate. Healthy digits
  runs measured here: 9-27 %.
* ``update_ratio_high`` / ``update_ratio_low``: the whole net's update-to-weight ratio
  ``||dW|| / ||W||`` against Karpathy's rule of thumb of about 1e-3 (CS231n "Neural Networks
  Part 3", "ratio of weights:updates"): flagged when its median over the recorded updates is
  at least ``ratio_high`` (1e-1: every update moves the weights by a tenth) or below
  ``ratio_low`` (1e-4), or when one layer's update is at least ``ratio_spike`` (1) times its
  weights (the weights replaced, not adjusted). Small nets run hotter than the rule: healthy
  digits runs measured here have medians of 3.6e-3..2.2e-2, SGD at 1e-3 (too slow) 8e-5.
* ``train_val_gap``: over the last ``patience`` (5) validated epochs the gap ``val_loss - loss``
  trends upwards and the validation loss too, its least-squares trend rising by more than
  ``generalization_loss`` (5 %) of its best, and the last validation loss is more than 5 %
  above its best: Prechelt's GL criterion (Prechelt 1998, "Early Stopping -- But When?", GL_5)
  joined to a widening gap, so a noisy validation set alone does not trigger it.
* ``plateau``: the best training loss of the last ``patience`` (5) epochs is not
  ``plateau_threshold`` (1 %) below the best before them -- ``ReduceLROnPlateau``'s rule (a
  patience and a relative threshold; torch's default threshold 1e-4 is below the epoch-to-epoch
  wander of a stalled run's mean loss, 0.5 % measured here on a dead network).

Each check returns its finding(s), ``None`` or ``""`` when it found nothing, or a non-empty string:
why it could not check (the data it needs is not in the run).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from events.schema import DiagnosticsRecorded, HistoryRecord, UpdateSkipped

__all__ = ["CHECKS", "Finding", "RunRecord", "Thresholds", "total_ratio"]


@dataclass(frozen=True)
class Thresholds:
    """The thresholds of :func:`diagnose` (see the module docstring for their sources)."""

    exploding_factor: float = 10.0
    diverge_factor: float = 4.0
    diverge_window: int = 5
    vanishing_ratio: float = 1e-3
    dead_fraction: float = 0.4
    ratio_guide: float = 1e-3
    ratio_high: float = 1e-1
    ratio_low: float = 1e-4
    ratio_spike: float = 1.0
    patience: int = 5
    generalization_loss: float = 0.05
    plateau_threshold: float = 0.01


@dataclass(frozen=True)
class Finding:
    """One problem :func:`diagnose` found: ``code`` (stable), a one-line ``title``, the ``evidence``
    (lines of numbers from the run), what to try (``advice``) and the ``threshold`` crossed."""

    code: str
    title: str
    evidence: tuple[str, ...]
    advice: str
    threshold: str


@dataclass
class RunRecord:
    """What :func:`diagnose` reads of a run's committed view.

    history: the committed epochs. steps / losses / grad_norms / clipped: one entry per committed
    update of the first optimizer (``grad_norm`` NaN when not computed). skipped: the skipped
    updates (all optimizers' events). records: the ``diagnostics_recorded`` events, in step order.
    status: ``running`` (no ``run_finalized``), ``completed``, ``stopped`` or ``failed``.
    """

    run_id: str
    status: str = "running"
    history: list[HistoryRecord] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    clipped: list[bool] = field(default_factory=list)
    skipped: list[UpdateSkipped] = field(default_factory=list)
    records: list[DiagnosticsRecorded] = field(default_factory=list)
    failure: str = ""


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _total(values: dict[str, float]) -> float:
    """The whole net's L2 norm from its layers' norms."""
    return math.sqrt(sum(v * v for v in values.values())) if values else math.nan


def total_ratio(r: DiagnosticsRecorded) -> float:
    """The net's ``||dW|| / ||W||`` of one record over the layers that got a gradient (from their ratios and
    weight norms): a layer behind dead units, which no update moves, is the dead_units finding, not a slow rate."""
    moved = {k: w for k, w in r.weight_norm.items() if r.grad_norm.get(k, 0.0) > 0}
    weight = _total(moved)
    delta = math.sqrt(sum((r.update_ratio.get(k, math.nan) * w) ** 2 for k, w in moved.items()))
    return delta / weight if weight > 0 else math.nan


def _slope(ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2, ..."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    den = sum((x - mx) ** 2 for x in range(n))
    return sum((x - mx) * (y - my) for x, y in zip(range(n), ys)) / den if den else 0.0


def _nonfinite(run: RunRecord, th: Thresholds) -> Finding | None:
    skips = [s for s in run.skipped if s.reason == "nonfinite"]
    if not skips:
        return None
    steps = sorted({(s.epoch, s.step) for s in skips})
    first = ", ".join(f"epoch {e} after step {st}" for e, st in steps[:3]) + (", ..." if len(steps) > 3 else "")
    details = sorted({s.detail for s in skips if s.detail})
    return Finding(
        code="nonfinite_updates",
        title=f"{len(steps)} update(s) skipped because a loss or gradient was not finite",
        evidence=(f"first: {first}", *(f"reason: {d}" for d in details[:2]),
                  f"{len(run.steps)} updates were committed"),
        advice="lower the learning rate or clip gradients (clip_grad_norm=); check the inputs for NaN/inf; with "
               "precision='fp16' a few skips while the scaler settles are expected",
        threshold="any (update_skipped reason 'nonfinite')",
    )


def _exploding(run: RunRecord, th: Thresholds) -> Finding | str:
    if run.records:
        series = [(r.step, _total(r.grad_norm)) for r in run.records]
        source = "diagnostics_recorded (per-layer norms, after clipping)"
    else:
        series = [(s, g) for s, g in zip(run.steps, run.grad_norms) if not math.isnan(g)]
        source = "the step receipts' grad_norm (before clipping)"
    series = [(s, g) for s, g in series if math.isfinite(g)]
    if len(series) < 2:
        return "needs two measured updates or more; record them with Diagnostics(every=N) or track_grad_norm=True"
    base = series[0][1]
    step, peak = max(series, key=lambda p: p[1])
    if base <= 0 or peak < th.exploding_factor * base:
        return ""
    clipped = sum(run.clipped)
    return Finding(
        code="exploding_gradients",
        title=f"the gradient norm reached {peak:.3g} at step {step}, {peak / base:.1f}x its {base:.3g} at step "
              f"{series[0][0]}",
        evidence=(f"from {source}, {len(series)} measured updates",
                  f"at the end (step {series[-1][0]}): {series[-1][1]:.3g}",
                  *([f"{clipped} of {len(run.clipped)} updates were clipped"] if clipped else [])),
        advice="lower the learning rate, clip the gradient norm (clip_grad_norm=), or warm the learning rate up",
        threshold=f"peak >= {th.exploding_factor:g}x the first measured update's norm (a spike: Pascanu et al. 2013)",
    )


def _divergence(run: RunRecord, th: Thresholds) -> tuple[int, float] | None:
    """``(step, median loss)`` of the first window of ``diverge_window`` committed updates whose median loss is
    at least ``diverge_factor`` times the first update's, or None (also without a finite first loss)."""
    finite = [(s, v) for s, v in zip(run.steps, run.losses) if math.isfinite(v)]
    if not finite or not run.losses or not math.isfinite(run.losses[0]) or run.losses[0] <= 0:
        return None
    limit, k = th.diverge_factor * run.losses[0], th.diverge_window
    for i in range(max(len(finite) - k + 1, 0)):
        window = [v for _, v in finite[i:i + k]]
        if (median := statistics.median(window)) >= limit:
            return finite[i + k - 1][0], median
    return None


def _diverged(run: RunRecord, th: Thresholds) -> Finding | str:
    if len(run.losses) < th.diverge_window + 1:
        return f"needs more than {th.diverge_window} committed updates, found {len(run.losses)}"
    found = _divergence(run, th)
    if found is None:
        return ""
    step, median = found
    first = run.losses[0]
    finite = _finite(run.losses)
    return Finding(
        code="loss_diverged",
        title=f"the training loss diverged: its median over {th.diverge_window} updates reached {median:.3g} at step "
              f"{step}, {median / first:.3g}x the first update's {first:.3g}",
        evidence=(f"{len(run.losses)} committed updates; the loss at the last: {run.losses[-1]:.3g}",
                  f"largest finite loss: {max(finite):.3g}"),
        advice="lower the learning rate (nnx-es report SPEC --lr-find suggests one), clip the gradient norm "
               "(clip_grad_norm=) or warm the learning rate up",
        threshold=f"median of {th.diverge_window} updates >= {th.diverge_factor:g}x the first update's loss (the "
                  "range test's divergence rule: Smith 2017, fastai, Lightning)",
    )


def _second_half(records: Sequence[DiagnosticsRecorded]) -> Sequence[DiagnosticsRecorded]:
    return records[len(records) // 2:]


def _vanishing(run: RunRecord, th: Thresholds) -> Finding | str:
    if not run.records:
        return "needs Diagnostics(every=N) records"
    half = _second_half(run.records)
    layers = list(half[-1].grad_norm)
    if len(layers) < 2:
        return "needs two layers or more"
    rel: dict[str, list[float]] = {k: [] for k in layers}
    for r in half:
        top = max(_finite(r.grad_norm.values()), default=0.0)
        if top > 0:
            for k in layers:
                v = r.grad_norm.get(k, math.nan)
                if math.isfinite(v):
                    rel[k].append(v / top)
    low = {k: statistics.median(v) for k, v in rel.items() if v and statistics.median(v) < th.vanishing_ratio}
    if not low:
        return ""
    last = half[-1]
    top_layer = max(last.grad_norm, key=lambda k: last.grad_norm[k] if math.isfinite(last.grad_norm[k]) else -1)
    names = ", ".join(sorted(low, key=layers.index))
    return Finding(
        code="vanishing_gradients",
        title=f"layer{'s' if len(low) > 1 else ''} {names} get{'' if len(low) > 1 else 's'} almost no gradient: "
              f"median {min(low.values()):.2g}x the largest layer's norm",
        evidence=tuple(f"layer {k}: gradient norm {last.grad_norm[k]:.3g} at step {last.step} (largest: layer "
                       f"{top_layer}, {last.grad_norm[top_layer]:.3g})" for k in sorted(low, key=layers.index)[:4]),
        advice="dead ReLUs upstream (see dead_units), saturating activations or a poor initialization: try "
               "Kaiming/Xavier init, normalization layers, residual connections or a lower learning rate",
        threshold=f"median over the second half of the records < {th.vanishing_ratio:g} of the largest layer's norm "
                  "(Glorot & Bengio 2010)",
    )


def _dead(run: RunRecord, th: Thresholds) -> Finding | str:
    counted = [r for r in run.records if r.dead_fraction]
    if not counted:
        return "needs Diagnostics records of ReLU-family modules (nn.ReLU, nn.LeakyReLU, ...)"
    half = _second_half(counted)
    modules = list(half[-1].dead_fraction)
    dead = {}
    for k in modules:
        values = _finite(r.dead_fraction.get(k, math.nan) for r in half)
        if values and statistics.median(values) >= th.dead_fraction:
            dead[k] = statistics.median(values)
    if not dead:
        return ""
    evidence = []
    for k in sorted(dead, key=modules.index)[:4]:
        crossed = next((r for r in counted if r.dead_fraction.get(k, 0.0) >= th.dead_fraction), None)
        evidence.append(f"module {k}: {counted[0].dead_fraction.get(k, math.nan):.0%} dead at step {counted[0].step}, "
                        f"{half[-1].dead_fraction[k]:.0%} at step {half[-1].step}"
                        + (f"; first at or above {th.dead_fraction:.0%} at step {crossed.step}" if crossed else ""))
    return Finding(
        code="dead_units",
        title=f"{', '.join(sorted(dead, key=modules.index))}: median {max(dead.values()):.0%} of units dead (never "
              "positive on a microbatch)",
        evidence=tuple(evidence),
        advice="a lower learning rate, Kaiming initialization, LeakyReLU/GELU, or a positive bias initialization; "
               "dead units from the start point at the initialization, dying during training at the learning rate",
        threshold=f"median over the second half of the records >= {th.dead_fraction:.0%} (CS231n: 'as much as 40% of "
                  "your network can be dead')",
    )


def _ratio(run: RunRecord, th: Thresholds) -> list[Finding] | str:
    if not run.records:
        return "needs Diagnostics(every=N) records"
    ratios = [(r.step, total_ratio(r)) for r in run.records]
    finite = _finite(v for _, v in ratios)
    if not finite:
        return "no finite update ratio recorded"
    median = statistics.median(finite)
    out = []
    guide = f"Karpathy's rule of thumb ~{th.ratio_guide:g} (CS231n, 'ratio of weights:updates')"
    spikes = [(r.step, k, v) for r in run.records for k, v in r.update_ratio.items()
              if math.isfinite(v) and v >= th.ratio_spike]
    if median >= th.ratio_high or spikes:
        evidence = [f"median update/weight ratio {median:.2g} over {len(finite)} recorded updates "
                    f"({median / th.ratio_guide:.0f}x the guide)"]
        if spikes:
            step, layer, value = max(spikes, key=lambda s: s[2])
            evidence.append(f"{len(spikes)} layer update(s) at least {th.ratio_spike:g}x the layer's weights; largest: "
                            f"layer {layer} at step {step}, {value:.3g}x")
        out.append(Finding(
            code="update_ratio_high",
            title=f"updates are too large for the weights (median ratio {median:.2g}"
                  + (f", a layer's update up to {max(s[2] for s in spikes):.3g}x its weights)" if spikes else ")"),
            evidence=tuple(evidence),
            advice="lower the learning rate (nnx-es report SPEC --lr-find suggests one)",
            threshold=f"median >= {th.ratio_high:g} or a layer's ratio >= {th.ratio_spike:g}; {guide}",
        ))
    elif median < th.ratio_low and _divergence(run, th) is None:  # diverged: huge weights, not a slow rate
        out.append(Finding(
            code="update_ratio_low",
            title=f"updates barely move the weights (median update/weight ratio {median:.2g})",
            evidence=(f"median over {len(finite)} recorded updates, {th.ratio_guide / median:.0f}x below the guide",
                      f"range {min(finite):.2g}..{max(finite):.2g}"),
            advice="raise the learning rate (nnx-es report SPEC --lr-find suggests one)",
            threshold=f"median < {th.ratio_low:g}; {guide}",
        ))
    return out or ""


def _gap(run: RunRecord, th: Thresholds) -> Finding | str:
    epochs = [(h.epoch, h.train["loss"], h.val["val_loss"]) for h in run.history
              if "val_loss" in h.val and "loss" in h.train and math.isfinite(h.val["val_loss"])
              and math.isfinite(h.train["loss"])]
    if len(epochs) < th.patience:
        return f"needs {th.patience} validated epochs with loss and val_loss, found {len(epochs)}"
    recent = epochs[-th.patience:]
    val = [v for _, _, v in recent]
    gap = [v - t for _, t, v in recent]
    best_epoch, best_train, best_val = min(epochs, key=lambda e: e[2])
    last_epoch, last_train, last_val = epochs[-1]
    gl = last_val / best_val - 1 if best_val > 0 else 0.0
    rise = _slope(val) * (len(val) - 1)  # the trend's rise over the window
    if not (rise > th.generalization_loss * best_val and _slope(gap) > 0 and gl > th.generalization_loss):
        return ""
    return Finding(
        code="train_val_gap",
        title=f"the train/validation gap widens: val_loss {last_val:.3g} at epoch {last_epoch} is {gl:.0%} above its "
              f"best {best_val:.3g} (epoch {best_epoch}) while the training loss fell to {last_train:.3g}",
        evidence=(f"gap (val_loss - loss) over epochs {recent[0][0]}..{last_epoch}: "
                  + ", ".join(f"{g:.3g}" for g in gap),
                  f"at the best epoch {best_epoch}: loss {best_train:.3g}, val_loss {best_val:.3g}"),
        advice="the model overfits: stop earlier (EarlyStopping, BEST keeps the best epoch), add regularization "
               "(weight decay, dropout, augmentation) or more data",
        threshold=f"over the last {th.patience} validated epochs val_loss trends up by > {th.generalization_loss:.0%} "
                  f"of its best and the gap widens, and val_loss ends > {th.generalization_loss:.0%} above its best "
                  "(Prechelt 1998, GL criterion)",
    )


def _plateau(run: RunRecord, th: Thresholds) -> Finding | str:
    losses = [(h.epoch, h.train["loss"]) for h in run.history if math.isfinite(h.train.get("loss", math.nan))]
    if len(losses) <= th.patience:
        return f"needs more than {th.patience} epochs with a finite training loss, found {len(losses)}"
    before = min(v for _, v in losses[:-th.patience])
    recent = losses[-th.patience:]
    best = min(v for _, v in recent)
    if best < before * (1 - th.plateau_threshold):
        return ""
    lrs = run.history[-1].lrs
    lr = next((f"{v[0]:.3g}" for v in lrs.values() if v), None)
    return Finding(
        code="plateau",
        title=f"the training loss stopped improving: best {best:.4g} over epochs {recent[0][0]}..{recent[-1][0]} "
              f"against {before:.4g} before",
        evidence=("training loss per epoch: " + ", ".join(f"{v:.4g}" for _, v in losses[-th.patience - 1:]),
                  *([f"learning rate at the end: {lr}"] if lr else [])),
        advice="if the loss is still high the optimizer is stuck: check dead units and the update ratio, try "
               "another learning rate (--lr-find) or a schedule; if it is low, the run has converged",
        threshold=f"no {th.plateau_threshold:.0%} relative improvement over the last {th.patience} epochs "
                  "(ReduceLROnPlateau's rule)",
    )


#: in the order a cause comes before its effects: a too large update kills units, which starve a layer of gradient
CHECKS = (
    ("skipped non-finite updates", _nonfinite), ("diverged loss", _diverged), ("exploding gradients", _exploding),
    ("update ratio", _ratio),
    ("dead units", _dead), ("vanishing gradients", _vanishing), ("train/validation gap", _gap),
    ("plateau", _plateau),
)
