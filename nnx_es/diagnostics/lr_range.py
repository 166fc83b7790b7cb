"""The learning-rate range test: ``lr_find(net, optimizer, loss, train_loader)``.

A short training run whose learning rate grows exponentially from ``min_lr`` to ``max_lr``
over ``steps`` committed updates (Smith 2017, "Cyclical Learning Rates for Training Neural
Networks", section 3.3; the finder of fastai and Lightning), then a suggestion from the loss
curve. It follows Lightning's ``lr_find`` (``lightning.pytorch.tuner.lr_finder``) in its
defaults and rules:

* sweep: ``min_lr=1e-8``, ``max_lr=1``, 100 updates, every parameter group at the same rate;
* the loss of each update is smoothed by an exponential moving average with bias correction,
  ``avg = beta * avg + (1 - beta) * loss``, ``smoothed = avg / (1 - beta ** (i + 1))`` with
  ``beta = 0.98``;
* the sweep stops early once the smoothed loss exceeds ``early_stop_threshold`` (4) times the
  best smoothed loss so far (divergence), and -- beyond Lightning, which records a NaN and
  goes on -- at the first update whose loss or gradient is not finite;
* the suggestion is the learning rate at the steepest descent of the smoothed loss, skipping
  the first ``skip_begin`` (10) and the last ``skip_end`` (1) points. The slope is taken
  against ``log(lr)`` (fastai's ``steep`` rule, and Lightning's before it weighted the slope by
  the spacing of the rates): on an exponential sweep that is the slope per update, so the
  sweep's many small early rates do not dominate it.

The sweep is a real run of :class:`~nnx_es.Trainer` (the batch contract, accumulation,
clipping, precision and hooks behave as in training) in a temporary runs root that is deleted
afterwards; it trains a copy of ``net`` with a fresh optimizer of the same class and settings,
so neither ``net`` nor ``optimizer`` is changed. ``nnx-es report SPEC --lr-find`` runs it on a
spec's model, optimizer, loss and data.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer

from nnx_es.artifacts import write_output
from nnx_es.callbacks import Callback
from nnx_es.errors import ConfigError, MissingDirectoryError, NonFiniteError

if TYPE_CHECKING:
    from events.schema import UpdateCommitted
    from nnx_es.runtime.context import TrainContext

__all__ = ["LRFinder", "lr_find", "suggest"]

#: Trainer keywords the sweep sets itself
_OWN = frozenset({"runs_root", "run_id", "callbacks", "schedulers", "monitor", "nonfinite", "progress", "metrics",
                  "validate_every", "validate_every_steps", "sinks"})


@dataclass(frozen=True)
class LRFinder:
    """The result of :func:`lr_find`.

    lrs: the learning rate of each committed update of the sweep (the first group's).
    losses: the smoothed training loss after each (see the module docstring); raw_losses: as read.
    suggestion: the suggested learning rate, or ``None`` when fewer than two points remain after
    the skipped ones (a loader too short, or a sweep that diverged at once). index: its position.
    stopped: why the sweep ended: ``"completed"`` (every step), ``"diverged"`` (the smoothed loss
    passed the threshold), ``"nonfinite"`` (a loss or gradient was not finite) or ``"exhausted"``
    (the loader ran out of batches before the sweep's steps).
    seconds: the sweep's wall time.
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    raw_losses: tuple[float, ...]
    suggestion: float | None
    index: int | None
    stopped: str
    min_lr: float
    max_lr: float
    steps: int
    seconds: float = 0.0

    def __str__(self) -> str:
        where = f"suggested learning rate {self.suggestion:.3g} (steepest descent of the smoothed loss, update " \
                f"{self.index})" if self.suggestion is not None else "no suggestion: too few points on the curve"
        return (f"lr range test: {len(self.lrs)} updates from {self.min_lr:g} to "
                f"{self.lrs[-1] if self.lrs else self.min_lr:.3g} ({self.stopped}; {self.seconds:.1f} s); {where}")

    def plot(self, out: str | Path) -> Path:
        """Write the loss against the learning rate (log scale), the suggestion marked, as an image.

        Raises:
            MissingDirectoryError: ``out``'s directory does not exist.
            ImportError: matplotlib is not installed (``pip install nnx_es[plots]``).
        """
        from nnx_es.plotting import missing_parent

        out = Path(out)
        if why := missing_parent(out):
            raise MissingDirectoryError(why)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
        ax.plot(self.lrs, self.raw_losses, color="0.75", linewidth=0.8, label="loss")
        ax.plot(self.lrs, self.losses, label="smoothed loss")
        if self.index is not None:
            ax.plot(self.lrs[self.index], self.losses[self.index], marker="o", color="red", markersize=8,
                    label=f"suggestion {self.suggestion:.3g}")
        ax.set(xscale="log", xlabel="learning rate", ylabel="training loss",
               title=f"lr range test ({len(self.lrs)} updates, {self.stopped})")
        finite = [v for v in (*self.losses, *self.raw_losses) if math.isfinite(v)]
        if finite and math.isfinite(self.losses[0]):  # the divergence at the end would flatten the curve
            low, high = min(finite), min(max(finite), 2 * self.losses[0])
            ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low) + 1e-12)
        ax.legend()
        write_output(out, lambda path: fig.savefig(path, dpi=110))  # never into a run, no link followed
        plt.close(fig)
        return out


def suggest(lrs: Iterable[float], losses: Iterable[float], *, skip_begin: int = 10,
            skip_end: int = 1) -> int | None:
    """The index of the steepest descent of ``losses`` against ``log(lrs)``, skipping the first
    ``skip_begin`` and last ``skip_end`` points and non-finite losses; ``None`` when fewer than two remain
    (Lightning's ``_LRFinder.suggestion`` rule, the slope against log(lr): see the module docstring)."""
    lr = np.asarray(list(lrs), dtype=np.float64)
    loss = np.asarray(list(losses), dtype=np.float64)
    index = np.arange(len(loss))[skip_begin:len(loss) - skip_end]
    keep = index[np.isfinite(loss[index]) & (lr[index] > 0)]
    if len(keep) < 2:
        return None
    slope = np.gradient(loss[keep], np.log(lr[keep]))
    return int(keep[int(np.argmin(slope))])


class _Sweep(Callback):
    """Records each update's rate and loss, smooths the loss and stops the sweep (Lightning's ``_LRCallback``)."""

    def __init__(self, steps: int, threshold: float | None, beta: float) -> None:
        self.steps, self.threshold, self.beta = steps, threshold, beta
        self.lrs: list[float] = []
        self.raw: list[float] = []
        self.smoothed: list[float] = []
        self.avg, self.best = 0.0, math.inf
        self.stopped = "exhausted"

    def on_optimizer_update(self, ctx: TrainContext, receipt: UpdateCommitted) -> None:
        if len(self.lrs) >= self.steps:
            return
        i = len(self.lrs)
        self.lrs.append(receipt.lrs[0] if receipt.lrs else math.nan)
        self.raw.append(receipt.loss)
        self.avg = self.beta * self.avg + (1 - self.beta) * receipt.loss
        smoothed = self.avg / (1 - self.beta ** (i + 1))
        self.smoothed.append(smoothed)
        if self.threshold is not None and i > 1 and smoothed > self.threshold * self.best:
            self.stopped = "diverged"
            ctx.stop_at_update()
        elif len(self.lrs) >= self.steps:
            self.stopped = "completed"
            ctx.stop_at_update()
        self.best = min(self.best, smoothed)


def _fresh_optimizer(optimizer: Optimizer | Callable[[Any], Optimizer], original: nn.Module,
                     copy_: nn.Module) -> Optimizer:
    """An optimizer of ``optimizer``'s class and settings over ``copy_``'s parameters (groups kept), or
    ``optimizer(copy_.parameters())`` when it is a factory."""
    if not isinstance(optimizer, Optimizer):
        if not callable(optimizer):
            raise ConfigError(f"lr_find(optimizer=) takes a torch optimizer or a factory params -> optimizer, got "
                              f"{optimizer!r}")
        return optimizer(copy_.parameters())
    position = {id(p): i for i, p in enumerate(original.parameters())}
    params = list(copy_.parameters())
    groups = []
    for g in optimizer.param_groups:
        missing = [p for p in g["params"] if id(p) not in position]
        if missing:
            raise ConfigError("lr_find: the optimizer holds parameters that are not the net's; pass a factory, "
                              "optimizer=lambda params: torch.optim.Adam(params, ...)")
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [params[position[id(p)]] for p in g["params"]]})
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError as exc:
        raise ConfigError(f"lr_find cannot rebuild {type(optimizer).__name__} from its defaults ({exc}); pass a "
                          "factory, optimizer=lambda params: ...") from None


def lr_find(net: nn.Module, optimizer: Optimizer | Callable[[Any], Optimizer], loss: Any,
            train_loader: Iterable[Any], *, min_lr: float = 1e-8, max_lr: float = 1.0, steps: int = 100,
            early_stop_threshold: float | None = 4.0, beta: float = 0.98, skip_begin: int = 10, skip_end: int = 1,
            plot: str | Path | None = None, seed: int = 0, **trainer: Any) -> LRFinder:
    """Run the learning-rate range test on a copy of ``net`` and suggest a learning rate (module docstring).

    Args:
        net: the model; a deep copy is trained (``net`` keeps its weights).
        optimizer: a torch optimizer over ``net``'s parameters (a fresh one of its class and settings is
            built over the copy; its state is not used), or a factory ``params -> optimizer``.
        loss: as ``Trainer(loss=)``.
        train_loader: the training batches (re-iterated when the sweep needs more than one pass).
        min_lr / max_lr: the sweep's first and last learning rate (> 0, min < max).
        steps: committed updates of the sweep (>= 2).
        early_stop_threshold: stop once the smoothed loss exceeds this times its best (None: never).
        beta: the smoothing factor in [0, 1).
        skip_begin / skip_end: points left out of the suggestion at each end.
        plot: also write the curve to this image path.
        seed: the sweep's ``Trainer(seed=)``.
        **trainer: other :class:`~nnx_es.Trainer` keywords (``accumulation``, ``clip_grad_norm``,
            ``precision``, ``hooks``, ``sample_weights``, ``train_step_fn``, ``device``, ...).

    Returns:
        :class:`LRFinder` (``.suggestion``, ``.lrs``, ``.losses``, ``.plot(path)``).

    Raises:
        ConfigError: a bad argument (named), before the sweep.
        MissingDirectoryError: ``plot``'s directory does not exist (before the sweep).
    """
    import time

    import nnx_es  # the Trainer by its public name, as nnx_es.recipes.runspec builds one

    if not (isinstance(min_lr, (int, float)) and isinstance(max_lr, (int, float)) and 0 < min_lr < max_lr
            and math.isfinite(max_lr)):
        raise ConfigError(f"lr_find needs 0 < min_lr < max_lr (finite), got min_lr={min_lr!r}, max_lr={max_lr!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ConfigError(f"lr_find(steps=) takes the sweep's updates, an int >= 2; got {steps!r}")
    if early_stop_threshold is not None and not early_stop_threshold > 1:
        raise ConfigError(f"lr_find(early_stop_threshold=) must be > 1 or None, got {early_stop_threshold!r}")
    if not 0 <= beta < 1:
        raise ConfigError(f"lr_find(beta=) must be in [0, 1), got {beta!r}")
    own = sorted(_OWN & set(trainer))
    if own:
        raise ConfigError(f"lr_find sets {own} itself (a throwaway run of its own); leave them out")
    if isinstance(optimizer, dict):
        raise ConfigError("lr_find sweeps one optimizer (as Lightning's finder); got several: run it per optimizer")
    if plot is not None:
        from nnx_es.plotting import missing_parent

        if why := missing_parent(Path(plot)):
            raise MissingDirectoryError(why)
    from nnx_es.schedulers import Scheduler

    model = copy.deepcopy(net)
    opt = _fresh_optimizer(optimizer, net, model)
    for group in opt.param_groups:
        group["lr"] = float(min_lr)
        group.pop("initial_lr", None)
    ratio = float(max_lr) / float(min_lr)
    sweep = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: ratio ** (min(k, steps - 1) / (steps - 1)))
    recorder = _Sweep(steps, early_stop_threshold, beta)
    try:
        per_epoch = len(train_loader)  # type: ignore[arg-type]
    except TypeError:
        per_epoch = 1
    accumulation = max(int(trainer.get("accumulation", 1) or 1), 1)
    epochs = max(1, math.ceil(steps * accumulation / max(per_epoch, 1))) + 1  # the sweep stops itself
    root = Path(tempfile.mkdtemp(prefix="nnx-es-lr-find-"))
    t0 = time.perf_counter()
    try:
        run = nnx_es.Trainer(model, opt, loss, runs_root=root, run_id="lr-find", progress=False, seed=seed,
                      schedulers=[Scheduler(sweep, clock="optimizer_update", name="lr_find")],
                      callbacks=[recorder], nonfinite="raise", **trainer)
        try:
            run.fit(train_loader, epochs=epochs)
        except NonFiniteError:
            recorder.stopped = "nonfinite"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds = time.perf_counter() - t0
    index = suggest(recorder.lrs, recorder.smoothed, skip_begin=skip_begin, skip_end=skip_end)
    result = LRFinder(
        lrs=tuple(recorder.lrs), losses=tuple(recorder.smoothed), raw_losses=tuple(recorder.raw),
        suggestion=recorder.lrs[index] if index is not None else None, index=index, stopped=recorder.stopped,
        min_lr=float(min_lr), max_lr=float(max_lr), steps=steps, seconds=seconds,
    )
    if plot is not None:
        result.plot(plot)
    return result
