"""Curves of a run for people: a PNG (matplotlib) and TensorBoard scalars.

Both are built from the log's committed view — the history projection for
per-epoch curves and the committed step receipts for per-update curves —
never from log lines. Needs the ``plots`` extra (matplotlib, tensorboard).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from events.log import LmdbLog
from events.schema import HistoryRecord, UpdateCommitted
from projections.view import committed, project

__all__ = ["export_tensorboard", "plot_run", "run_curves"]


def _open(run_dir: Path) -> LmdbLog:
    return LmdbLog(Path(run_dir) / "events.lmdb", readonly=True)


def _receipts(log: LmdbLog) -> Iterator[UpdateCommitted]:
    for _, e in committed(log.read()):
        if type(e) is UpdateCommitted:
            yield e


def run_curves(run_dir: str | Path) -> tuple[tuple[HistoryRecord, ...], list[tuple[int, float, list[float]]]]:
    """(history records, [(step, loss, lrs) per committed update of the first optimizer])."""
    with _open(Path(run_dir)) as log:
        history = project(log.read()).history.records
        seen: set[int] = set()
        updates = []
        for r in _receipts(log):
            if r.step not in seen:
                seen.add(r.step)
                updates.append((r.step, r.loss, r.lrs))
    return history, updates


def plot_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write a PNG with loss, metric and learning-rate curves, per epoch and per committed update.

    Raises:
        ImportError: matplotlib is not installed (``pip install nnx_es[plots]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, updates = run_curves(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    ax_loss, ax_metric, ax_step, ax_lr = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    epochs = [r.epoch for r in history]
    for key in sorted({k for r in history for k in (*r.train, *r.val)}):
        ys = [r.train.get(key, r.val.get(key)) for r in history]
        target = ax_loss if "loss" in key else ax_metric
        target.plot(epochs, ys, marker="o", markersize=3, label=key)
    for r in history:
        if r.improved:
            ax_loss.axvline(r.epoch, color="0.85", linewidth=0.8, zorder=0)
    ax_loss.set(title="loss per epoch (grey: monitor improved)", xlabel="epoch")
    ax_metric.set(title="metrics per epoch", xlabel="epoch")
    if updates:
        ax_step.plot([u[0] for u in updates], [u[1] for u in updates], linewidth=0.8)
    ax_step.set(title="training loss per committed update", xlabel="optimizer step")
    for name in sorted({n for r in history for n in r.lrs}):
        groups = max(len(r.lrs.get(name, [])) for r in history)
        for g in range(groups):
            ax_lr.plot(epochs, [r.lrs.get(name, [float("nan")] * groups)[g] for r in history],
                       marker="o", markersize=3, label=f"{name}[{g}]")
    ax_lr.set(title="learning rate per epoch", xlabel="epoch", yscale="log")
    for ax in (ax_loss, ax_metric, ax_lr):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"run {Path(run_dir).name}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def export_tensorboard(run_dir: str | Path, out_dir: str | Path) -> int:
    """Write TensorBoard scalars (``epoch/<metric>``, ``epoch/lr/<opt>/<group>``,
    ``update/loss``, ``update/grad_norm``, ``update/lr/<opt>``); return how many were written.

    Raises:
        ImportError: tensorboard is not installed (``pip install nnx_es[plots]``).
    """
    from torch.utils.tensorboard import SummaryWriter

    n = 0
    with _open(Path(run_dir)) as log:
        history = project(log.read()).history.records
        writer = SummaryWriter(log_dir=str(out_dir))
        try:
            for r in history:
                for key, value in (*r.train.items(), *r.val.items()):
                    writer.add_scalar(f"epoch/{key}", value, r.epoch)
                    n += 1
                for opt, lrs in r.lrs.items():
                    for g, lr in enumerate(lrs):
                        writer.add_scalar(f"epoch/lr/{opt}/{g}", lr, r.epoch)
                        n += 1
            for u in _receipts(log):
                writer.add_scalar(f"update/loss/{u.optimizer}", u.loss, u.step)
                n += 1
                if u.grad_norm is not None:
                    writer.add_scalar(f"update/grad_norm/{u.optimizer}", u.grad_norm, u.step)
                    n += 1
                writer.add_scalar(f"update/lr/{u.optimizer}", u.lrs[0] if u.lrs else float("nan"), u.step)
                n += 1
        finally:
            writer.close()
    return n
