"""Curves of a run for people: a PNG (matplotlib) and TensorBoard scalars.

Both are built from the log's committed view — the history projection for
per-epoch curves and the committed step receipts for per-update curves —
never from log lines, in one pass over the log that holds a chunk of it at a
time: the plot keeps the per-update loss as a min/max envelope over at most
:data:`PLOT_BUCKETS` buckets of steps (exact while the run has fewer updates),
the export writes every receipt. The plot needs matplotlib, the export
TensorBoard's ``SummaryWriter`` as torch ships it (the ``plots`` extra). The
writer checksums each scalar in Python (tens of µs each): a run of ten million
events exports in minutes, with a progress display on a terminal.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from events.codec import TYPE_CODES, partial_decoder, partial_type
from events.log import LmdbLog
from events.schema import (
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    RunResumed,
    UpdateCommitted,
)
from nnx_es.errors import MissingDirectoryError
from projections.view import MicrobatchRequired, committed

__all__ = ["PLOT_BUCKETS", "Envelope", "committed_curves", "committed_of", "export_tensorboard", "missing_parent",
           "plot_run", "run_curves"]

#: most buckets of steps the plot's per-update loss is drawn with (a min and a max each)
PLOT_BUCKETS = 4096

#: committed events sorted at once (their receipts handed to a consumer together)
_BATCH = 2048
_STEP, _LOSS = attrgetter("step"), attrgetter("loss")


#: an ``update_committed`` as the curves read it (its required fields checked; ``clipped`` and others skipped)
_Receipt = partial_type(UpdateCommitted, "grad_norm", "lrs", "optimizer")


_decode = partial_decoder({UpdateCommitted: _Receipt, MicrobatchDone: MicrobatchRequired})


def _open(run_dir: Path) -> LmdbLog:
    return LmdbLog(Path(run_dir) / "events.lmdb", readonly=True)


def committed_of(log: LmdbLog, types: Iterable[type], decode: Callable[[list[Any], int], tuple[list[Any], bytes]]
                 = _decode) -> Iterator[tuple[int, Any]]:
    """The committed ``(seq, event)`` pairs of ``types`` (and the LASTs and resumes that decide them), read a
    chunk at a time and decoded by ``decode`` (a :func:`events.codec.partial_decoder`: the kinds a reader skips
    cost little), in log order. The committed view (:func:`projections.committed`) taken over these events alone
    commits the same ones as over the whole log (see :func:`_committed_curves`); with ``RunFinalized`` among
    ``types`` a finalized run's closing events in its tail are given too."""
    codes = {TYPE_CODES[t] for t in (*types, LastCommitted, RunResumed)}
    kept = bytes(int(code in codes) for code in range(256))  # a translate table of type codes

    def marks() -> Iterator[tuple[int, Any]]:
        for first, values in log.read_chunks():
            events, found = decode(values, first)
            yield from itertools.compress(zip(itertools.count(first), events), found.translate(kept))

    return committed(marks())


def committed_curves(log: LmdbLog, on_receipts: Callable[[list[Any]], None]) -> tuple[HistoryRecord, ...]:
    """Hand the committed receipts to ``on_receipts`` in batches, in log order; return the history projection.

    The committed view (:func:`projections.committed`) is taken over receipts,
    ``history_appended``, LASTs and resumes only. That commits the same receipts and
    records: a LAST commits the pending ones up to its ``covers`` (all of them when
    ``covers < 0``) and a resume drops them, whatever else is pending; the events left
    out only decide whether a BEST or phase commit belongs to a LAST's group and which
    closing events a finalized tail contributes. The history projection is the
    committed records in order (:func:`projections.fold_history`). Receipts are
    ``_Receipt`` s, or ``UpdateCommitted`` s upcast from a legacy version.
    """
    history: list[HistoryRecord] = []
    events = map(itemgetter(1), committed_of(log, (UpdateCommitted, HistoryAppended)))
    while batch := list(itertools.islice(events, _BATCH)):
        receipts = [e for e in batch if type(e) is _Receipt or type(e) is UpdateCommitted]
        if receipts:
            on_receipts(receipts)
        history.extend(e.record for e in batch if type(e) is HistoryAppended)
    return tuple(history)


class Envelope:
    """A curve of ``(step, value)`` points, in increasing steps, kept in at most ``buckets`` buckets.

    Bucket ``i`` holds the steps ``s`` with ``s >> shift == i``; it keeps the count,
    the mean step, the least and the greatest value of its points (NaNs left out; a
    bucket of NaNs only has NaN for both). ``shift`` starts at 0, one step a bucket,
    and grows by one (neighbouring buckets merged) whenever a step would not fit.
    So memory is O(buckets) whatever the number of points, and the curve is exact
    while the steps stay below ``buckets``.

    Args:
        buckets: a positive even number.
    """

    def __init__(self, buckets: int = PLOT_BUCKETS) -> None:
        if buckets < 2 or buckets % 2:
            raise ValueError(f"buckets: expected a positive even number, got {buckets}")
        self.shift = 0
        self.count = np.zeros(buckets, dtype=np.int64)
        self.step_sum = np.zeros(buckets)
        self.low = np.full(buckets, np.nan)
        self.high = np.full(buckets, np.nan)

    def add(self, steps: np.ndarray, values: np.ndarray) -> None:
        """Add points; ``steps`` (int64, non-negative) increase, also over successive calls."""
        if not len(steps):
            return
        while steps[-1] >> self.shift >= len(self.count):
            self._merge()
        index = steps >> self.shift
        starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
        at = index[starts]
        self.count[at] += np.diff(np.r_[starts, len(steps)])
        self.step_sum[at] += np.add.reduceat(steps.astype(np.float64), starts)
        self.low[at] = np.fmin(self.low[at], np.fmin.reduceat(values, starts))
        self.high[at] = np.fmax(self.high[at], np.fmax.reduceat(values, starts))

    def _merge(self) -> None:
        n = len(self.count)
        for name, pair in (("count", np.add), ("step_sum", np.add), ("low", np.fmin), ("high", np.fmax)):
            a = getattr(self, name)
            merged = np.full_like(a, np.nan) if name in ("low", "high") else np.zeros_like(a)
            merged[: n // 2] = pair(a[0::2], a[1::2])
            setattr(self, name, merged)
        self.shift += 1

    @property
    def steps_per_bucket(self) -> int:
        return 1 << self.shift

    def line(self) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` to draw: per non-empty bucket, ``(mean step, least)`` then ``(mean step, greatest)``
        when they differ, one point when the bucket holds one."""
        full = self.count > 0
        x = self.step_sum[full] / self.count[full]
        low, high = self.low[full], self.high[full]
        two = (self.count[full] > 1) & ~(low == high)
        xs = np.repeat(x, np.where(two, 2, 1))
        ys = np.stack([low, high], axis=1)[np.stack([np.ones_like(two), two], axis=1)]
        return xs, ys


def _loss_envelope(envelope: Envelope) -> Callable[[list[Any]], None]:
    """Feed the first receipt of each step (the first optimizer's) to ``envelope``."""
    last = -1

    def take(receipts: list[Any]) -> None:
        nonlocal last
        steps = np.fromiter(map(_STEP, receipts), dtype=np.int64, count=len(receipts))
        losses = np.fromiter(map(_LOSS, receipts), dtype=np.float64, count=len(receipts))
        first = steps > np.maximum.accumulate(np.r_[last, steps[:-1]])
        last = max(last, int(steps[-1]))
        envelope.add(steps[first], losses[first])

    return take


def run_curves(run_dir: str | Path, buckets: int = PLOT_BUCKETS) -> tuple[tuple[HistoryRecord, ...], Envelope]:
    """(history records, the training loss of each committed update of the first optimizer, as an :class:`Envelope`)."""
    envelope = Envelope(buckets)
    with _open(Path(run_dir)) as log:
        history = committed_curves(log, _loss_envelope(envelope))
    return history, envelope


def missing_parent(out: Path) -> str | None:
    """Why ``out`` cannot be written because its directory does not exist (naming it), or None."""
    parent = out.parent
    if parent.is_dir():
        return None
    what = "is not a directory" if parent.exists() else "does not exist"
    return f"cannot write {str(out)!r}: its directory {str(parent)!r} {what}; create it first or choose another path"


def plot_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write a PNG with loss, metric and learning-rate curves, per epoch and per committed update.

    Raises:
        MissingDirectoryError: ``out``'s directory does not exist (it is not created: a mistyped
            path would otherwise leave the image somewhere unexpected); checked before anything is read.
        ImportError: matplotlib is not installed (``pip install nnx_es[plots]``).
    """
    out = Path(out)
    if why := missing_parent(out):
        raise MissingDirectoryError(why)
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
    xs, ys = updates.line()
    if len(xs):
        ax_step.plot(xs, ys, linewidth=0.8)
    per = updates.steps_per_bucket
    ax_step.set(title="training loss per committed update" + (f" (min-max per {per} steps)" if per > 1 else ""),
                xlabel="optimizer step")
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
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


class _Scalars:
    """TensorBoard's ``SummaryWriter`` fed a column of scalars at a time."""

    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # the plots extra; torch ships the writer

        self._writer = SummaryWriter(log_dir=str(out_dir))

        self._progress: Any = None
        if sys.stderr.isatty():  # long exports show how far they got; none off a terminal
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(SpinnerColumn(), TextColumn("exporting scalars: {task.completed:,}"),
                                      TimeElapsedColumn(), transient=True)
            self._task = self._progress.add_task("export", total=None)

    def add_scalars(self, tag: str, steps: np.ndarray, values: np.ndarray) -> int:
        add = self._writer.add_scalar
        for step, value in zip(steps.tolist(), values.tolist()):
            add(tag, value, step)
        if self._progress is not None:
            self._progress.advance(self._task, len(steps))
        return len(steps)

    def __enter__(self) -> _Scalars:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._writer.close()


class _ReceiptScalars:
    """Writes ``update/loss/<opt>``, ``update/grad_norm/<opt>`` (when computed) and ``update/lr/<opt>``
    (the first group's rate) of each receipt, a batch at a time; counts them in ``written``."""

    def __init__(self, writer: _Scalars) -> None:
        self.writer = writer
        self.written = 0

    def __call__(self, receipts: list[Any]) -> None:
        by_optimizer: dict[str, list[Any]] = {}
        for r in receipts:
            by_optimizer.setdefault(r.optimizer, []).append(r)
        for opt, rs in by_optimizer.items():
            steps = np.fromiter(map(_STEP, rs), dtype=np.int64, count=len(rs))
            losses = np.fromiter(map(_LOSS, rs), dtype=np.float64, count=len(rs))
            self.written += self.writer.add_scalars(f"update/loss/{opt}", steps, losses)
            normed = [i for i, r in enumerate(rs) if r.grad_norm is not None]
            if normed:
                norms = np.array([rs[i].grad_norm for i in normed])
                self.written += self.writer.add_scalars(f"update/grad_norm/{opt}", steps[normed], norms)
            lrs = np.array([r.lrs[0] if r.lrs else math.nan for r in rs])
            self.written += self.writer.add_scalars(f"update/lr/{opt}", steps, lrs)


def export_tensorboard(run_dir: str | Path, out_dir: str | Path) -> int:
    """Write TensorBoard scalars (``epoch/<metric>``, ``epoch/lr/<opt>/<group>``,
    ``update/loss/<opt>``, ``update/grad_norm/<opt>``, ``update/lr/<opt>``) to a new event
    file in ``out_dir``; return how many were written. Every committed receipt is written.

    Raises:
        OSError: ``out_dir`` cannot be written.
    """
    with _open(Path(run_dir)) as log, _Scalars(Path(out_dir)) as writer:
        receipts = _ReceiptScalars(writer)
        history = committed_curves(log, receipts)
        series: dict[str, tuple[list[int], list[float]]] = {}
        for r in history:
            points = [(f"epoch/{key}", value) for key, value in (*r.train.items(), *r.val.items())]
            points += [(f"epoch/lr/{opt}/{g}", lr) for opt, lrs in r.lrs.items() for g, lr in enumerate(lrs)]
            for tag, value in points:
                epochs, values = series.setdefault(tag, ([], []))
                epochs.append(r.epoch)
                values.append(value)
        written = receipts.written
        for tag, (epochs, values) in series.items():
            written += writer.add_scalars(tag, np.array(epochs, dtype=np.int64), np.array(values, dtype=np.float64))
    return written
