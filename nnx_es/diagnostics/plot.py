"""The picture of a :class:`~nnx_es.diagnostics.findings.Diagnosis` (``nnx-es diagnose RUN --plot PATH``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnx_es.artifacts import write_output
from nnx_es.errors import MissingDirectoryError, UnsafePathError

if TYPE_CHECKING:
    from nnx_es.diagnostics.findings import Diagnosis

__all__ = ["MAX_LINES", "check_plot_path", "plot_diagnosis"]

#: the most layers (or activation modules) drawn in one panel: the first ones in the net's module order
MAX_LINES = 12


def _label(text: str) -> str:
    """A name from the run's log as matplotlib text: no mathtext (``$`` escaped), no controls, 48 characters at most."""
    text = "".join(c if c.isprintable() else "?" for c in str(text))[:48]
    return text.replace("$", r"\$")


def check_plot_path(out: str | Path, run_dir: str | Path) -> Path:
    """``out`` as a place for the picture of ``run_dir``'s diagnosis: its directory exists and it is not
    inside the run (diagnosing only reads a run, which may be someone else's: nothing is written there).

    Raises:
        MissingDirectoryError: ``out``'s directory does not exist.
        UnsafePathError: ``out`` is inside ``run_dir``.
    """
    from nnx_es.plotting import missing_parent

    out = Path(out)
    if why := missing_parent(out):
        raise MissingDirectoryError(why)
    where, run = out.parent.resolve() / out.name, Path(run_dir).resolve()
    if where == run or run in where.parents:
        raise UnsafePathError(f"--plot {str(out)!r} is inside the run {str(run)!r}: diagnose writes nothing into a "
                              "run (it may be someone else's); give a path outside it")
    return out


def plot_diagnosis(diagnosis: Diagnosis, out: str | Path) -> Path:
    """Write a PNG of the run's losses, per-layer gradient norms, update-to-weight ratios, weight norms,
    activation statistics and dead units, skipped updates marked and the findings in the title.

    Raises:
        MissingDirectoryError / UnsafePathError: see :func:`check_plot_path` (checked first).
        ImportError: matplotlib is not installed (``pip install nnx_es[plots]``).
    """
    from nnx_es.diagnostics.checks import total_ratio

    out = check_plot_path(out, diagnosis.run_dir)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run, th = diagnosis.run, diagnosis.thresholds
    records = run.records
    steps = [r.step for r in records]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    ax_loss, ax_grad, ax_ratio = axes[0]
    ax_weight, ax_act, ax_dead = axes[1]

    per_epoch = max(len(run.steps) / max(len(run.history), 1), 1.0)
    if run.steps:
        ax_loss.plot(run.steps, run.losses, color="0.8", linewidth=0.6, label="loss per update")
    if run.history:
        ends = [h.counters.step or (i + 1) * per_epoch for i, h in enumerate(run.history)]
        ax_loss.plot(ends, [h.train.get("loss", math.nan) for h in run.history], marker="o", markersize=3,
                     label="loss per epoch")
        if any("val_loss" in h.val for h in run.history):
            ax_loss.plot(ends, [h.val.get("val_loss", math.nan) for h in run.history], marker="o", markersize=3,
                         label="val_loss")
    ax_loss.set(title="training and validation loss", xlabel="optimizer step")

    def layered(ax: Any, field: str, title: str) -> None:
        names = list(getattr(records[-1], field)) if records else []
        for name in names[:MAX_LINES]:
            ax.plot(steps, [getattr(r, field).get(name, math.nan) for r in records], label=_label(name))
        shown = f" (first {MAX_LINES} of {len(names)})" if len(names) > MAX_LINES else ""
        ax.set(title=title + shown, xlabel="optimizer step", yscale="log" if records else "linear")

    layered(ax_grad, "grad_norm", "gradient L2 norm per layer")
    if not records and any(math.isfinite(g) for g in run.grad_norms):
        ax_grad.plot(run.steps, run.grad_norms, label="total (receipts)")
        ax_grad.set_yscale("log")
    layered(ax_ratio, "update_ratio", "update / weight ratio per layer")
    if records:
        ax_ratio.plot(steps, [total_ratio(r) for r in records], color="black", linewidth=1.2, label="net")
        ax_ratio.axhline(th.ratio_guide, color="green", linestyle="--", linewidth=0.8, label=f"~{th.ratio_guide:g}")
        for level in (th.ratio_low, th.ratio_high):
            ax_ratio.axhline(level, color="red", linestyle=":", linewidth=0.8)
    layered(ax_weight, "weight_norm", "weight L2 norm per layer")
    acts = list(records[-1].activation_mean)[:MAX_LINES] if records else []
    for name in acts:
        mean = [r.activation_mean.get(name, math.nan) for r in records]
        std = [r.activation_std.get(name, math.nan) for r in records]
        line, = ax_act.plot(steps, mean, label=f"{_label(name)} mean")
        ax_act.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.2)
    ax_act.set(title="activation mean +- std", xlabel="optimizer step")
    dead = list(records[-1].dead_fraction)[:MAX_LINES] if records else []
    for name in dead:
        ax_dead.plot(steps, [r.dead_fraction.get(name, math.nan) for r in records], label=_label(name))
    if dead:
        ax_dead.axhline(th.dead_fraction, color="red", linestyle=":", linewidth=0.8, label=f"{th.dead_fraction:.0%}")
    ax_dead.set(title="dead units (ReLU family)", xlabel="optimizer step", ylim=(-0.02, 1.02))
    skipped = sorted({s.step for s in run.skipped if s.reason == "nonfinite"})
    for ax in axes.flat:
        for s in skipped[:200]:
            ax.axvline(s + 0.5, color="red", alpha=0.3, linewidth=0.6)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        if not ax.has_data():
            ax.text(0.5, 0.5, "not recorded (Diagnostics(every=N))", ha="center", va="center", transform=ax.transAxes,
                    color="0.5")
    codes = ", ".join(diagnosis.codes) or "no findings"
    marked = " -- red lines: skipped non-finite updates" if skipped else ""
    fig.suptitle(f"run {_label(run.run_id)} ({_label(run.status)}): {codes}{marked}")
    write_output(out, lambda path: fig.savefig(path, dpi=100))  # never into a run, no link followed
    plt.close(fig)
    return out
