"""Live logging sinks fed from the run's events as they are committed -- never from log lines.

``Trainer(sinks=[TensorBoardSink("tb/"), CsvSink("metrics/")])`` writes, while the run trains,
what ``tools/inspect RUN export --tensorboard`` writes after it (the same tags), and CSV files of
epochs and updates. MLflow (:class:`MlflowSink`) logs the same scalars when ``mlflow`` is installed.

How: after each durable LAST (and at the run's end) the training thread reads the values written
since the last hand-off back from the log (the one log handle it owns: nothing else touches LMDB)
and hands them on; the sinks take them through the committed view (:func:`projections.committed`:
an uncommitted tail never reaches a sink) and write each committed event. The built-in sinks
(``out_of_process = True``) run in a forked child process, which decodes and writes on the other
core, so their Python work never contends with training for the interpreter lock; any other sink
(an object with ``open``/``write``/``close``) runs on a thread of the training process. A sink
that raises is dropped and warned about (:class:`SinkWarning`, at the run's end for a child's);
the run never fails because of a sink, and waits for the sinks only at its very end (bounded).
A run killed (SIGKILL) leaves no sink process behind: the child sees the pipe close, writes what it
was handed and closes its sinks.
Sinks run on the writer rank only. Semantics: issue "Several models, distillation, fine-tuning, real metrics and live
logging" (live logging); the tags are :func:`nnx_es.plotting.export_tensorboard`'s.
"""

from __future__ import annotations

import csv
import math
import multiprocessing
import os
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog

from events.codec import decode
from events.paths import create_file, open_dir
from events.schema import Event, HistoryAppended, LastCommitted, UpdateCommitted
from projections.view import committed

__all__ = ["CsvSink", "LiveSinks", "MlflowSink", "Sink", "SinkWarning", "TensorBoardSink", "scalars_of"]

log = structlog.get_logger("nnx_es")


class SinkWarning(RuntimeWarning):
    """A live logging sink failed and was dropped (the run goes on)."""


class Sink(Protocol):
    """A live logging sink: ``open(run_dir)`` once, ``write(seq, event)`` per committed event, ``close()``.

    A session feeds a sink the committed events from its own start (``run_started`` or
    ``run_resumed``) on; a sink with ``from_start = True`` (one that rewrites its output each
    session, like :class:`CsvSink`) is fed the run's whole committed log from seq 0 instead, so a
    resumed run's files still hold the epochs before the resume.
    """

    def open(self, run_dir: Path) -> None: ...

    def write(self, seq: int, event: Event) -> None: ...

    def close(self) -> None: ...


def scalars_of(event: Event) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of the scalars a committed event carries, as the TensorBoard export tags them:
    ``update/loss/<opt>``, ``update/grad_norm/<opt>``, ``update/lr/<opt>`` (step: the update),
    ``epoch/<metric>``, ``epoch/lr/<opt>/<group>`` (step: the epoch)."""
    if isinstance(event, UpdateCommitted):
        out = [(f"update/loss/{event.optimizer}", event.step, float(event.loss))]
        if event.grad_norm is not None:
            out.append((f"update/grad_norm/{event.optimizer}", event.step, float(event.grad_norm)))
        out.append((f"update/lr/{event.optimizer}", event.step, float(event.lrs[0]) if event.lrs else math.nan))
        return out
    if isinstance(event, HistoryAppended):
        r = event.record
        out = [(f"epoch/{k}", r.epoch, float(v)) for k, v in (*r.train.items(), *r.val.items())]
        out += [(f"epoch/lr/{opt}/{g}", r.epoch, float(lr)) for opt, lrs in r.lrs.items() for g, lr in enumerate(lrs)]
        return out
    return []


class TensorBoardSink:
    """TensorBoard scalars, live, into ``log_dir`` (default: ``<run>/views/tensorboard``); needs the
    ``plots`` extra (``tensorboard``).

    The event file is flushed at each committed LAST: ``SummaryWriter`` writes on its own every
    ``flush_secs`` (120 s) or ten events, and a run killed (SIGKILL) between two of those left its
    last epochs' scalars in the writer's memory -- the sink's process ends without closing it. So
    what a killed run committed is in TensorBoard as it is in the log (a ``CsvSink`` flushes each row).
    """

    distributed = "writer"  # a sink writes: the writer rank alone feeds it

    out_of_process = True

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._writer: Any = None

    def open(self, run_dir: Path) -> None:
        """Raises: UnsafePathError: ``views/`` or ``views/tensorboard/`` under the run is a symbolic link."""
        from torch.utils.tensorboard import SummaryWriter

        if self.log_dir is None:  # under the run: made without following a link (the writer opens its files)
            os.close(open_dir(run_dir.parent, (run_dir.name, "views", "tensorboard"), create=True))
        self._writer = SummaryWriter(log_dir=str(self.log_dir or run_dir / "views" / "tensorboard"))

    def write(self, seq: int, event: Event) -> None:
        for tag, step, value in scalars_of(event):
            self._writer.add_scalar(tag, value, step)
        if isinstance(event, LastCommitted):  # a commit: its scalars reach the file now
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class CsvSink:
    """``epochs.csv`` (one row per committed epoch: epoch, metrics, learning rates) and ``updates.csv``
    (one row per committed update receipt) in ``out_dir`` (default: ``<run>/views``), appended live."""

    distributed = "writer"  # a sink writes: the writer rank alone feeds it

    out_of_process = True

    from_start = True  # rewrites its files each session: a resumed run's earlier rows come from the log again

    def __init__(self, out_dir: str | Path | None = None) -> None:
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self._files: dict[str, Any] = {}
        self._writers: dict[str, Any] = {}
        self._epoch_columns: list[str] | None = None

    def open(self, run_dir: Path) -> None:
        """Raises: UnsafePathError: ``views/`` under the run (or a file the sink writes) is a symbolic link."""
        # under the run, nothing is followed (events.paths); an out_dir of the caller's is taken as named
        self._where: tuple[Path, tuple[str, ...]] = (self.out_dir, ()) if self.out_dir else \
            (run_dir.parent, (run_dir.name, "views"))
        self._where[0].mkdir(parents=True, exist_ok=True)
        os.close(open_dir(*self._where, create=True))

    def _writer(self, name: str, header: list[str]) -> Any:
        if name not in self._writers:
            anchor, dirs = self._where
            f = os.fdopen(create_file(anchor, (*dirs, name)), "w", newline="")  # noqa: SIM115 - closed in close()
            self._files[name] = f
            self._writers[name] = csv.writer(f)
            self._writers[name].writerow(header)
        return self._writers[name]

    def write(self, seq: int, event: Event) -> None:
        if isinstance(event, UpdateCommitted):
            self._writer("updates.csv", ["step", "epoch", "optimizer", "loss", "examples", "grad_norm", "lr"]).writerow(
                [event.step, event.epoch, event.optimizer, event.loss, event.global_examples,
                 "" if event.grad_norm is None else event.grad_norm, event.lrs[0] if event.lrs else ""])
        elif isinstance(event, HistoryAppended):
            r = event.record
            values = {**r.train, **r.val, **{f"lr/{o}/{g}": lr for o, lrs in r.lrs.items() for g, lr in enumerate(lrs)}}
            if self._epoch_columns is None:
                self._epoch_columns = sorted(values)
            self._writer("epochs.csv", ["epoch", *self._epoch_columns]).writerow(
                [r.epoch, *(values.get(c, "") for c in self._epoch_columns)])
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class MlflowSink:
    """The same scalars as :class:`TensorBoardSink`, logged to the active MLflow run (``mlflow``
    must be installed; a sink that cannot import it is warned about and dropped at open)."""

    distributed = "writer"  # a sink writes: the writer rank alone feeds it

    out_of_process = True

    def open(self, run_dir: Path) -> None:
        import mlflow  # optional dependency

        self._mlflow = mlflow

    def write(self, seq: int, event: Event) -> None:
        for tag, step, value in scalars_of(event):
            self._mlflow.log_metric(tag.replace("/", "."), value, step=step)

    def close(self) -> None:
        pass


_END = None


class _Feed:
    """Runs sinks over batches of ``(seq, raw value)``: decode, committed view, write; records failures."""

    def __init__(self, run_dir: Path, sinks: Sequence[Sink], start: int = 0) -> None:
        self.run_dir, self.sinks, self.start = run_dir, list(sinks), start
        self.failures: list[str] = []

    def _call(self, sink: Sink, what: str, *args: Any) -> bool:
        try:
            getattr(sink, what)(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - a sink never fails the run
            self.failures.append(f"live sink {type(sink).__name__} failed in {what} ({type(exc).__name__}: {exc}) "
                                 "and was dropped; the run went on")
            return False

    def run(self, batches: Iterator[list[tuple[int, bytes]]]) -> None:
        live = [s for s in self.sinks if self._call(s, "open", self.run_dir)]
        events = ((seq, decode(raw, seq)) for batch in batches for seq, raw in batch)
        for seq, event in committed(events):
            live = [s for s in live if (seq < self.start and not getattr(s, "from_start", False))
                    or self._call(s, "write", seq, event)]
        for s in live:
            self._call(s, "close")


def _child(conn: Any, feed: _Feed, inherited: Any) -> None:
    """The sink process: read batches until the end marker -- or until the training process is gone
    (killed: the pipe's end of the training process closed) -- then close the sinks and report the
    failures.

    ``inherited``: the training process's end of the pipe, which the fork copied here; closed
    first, or the pipe would never close while this process lives and, the training process
    killed, it would wait for a batch forever."""
    inherited.close()

    def batches() -> Iterator[list[tuple[int, bytes]]]:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):  # the training process is gone: what it handed on is written, then closed
                return
            if batch is _END:
                return
            yield batch

    try:
        feed.run(batches())
    except Exception as exc:  # noqa: BLE001 - reported to the parent, never raised into training
        feed.failures.append(f"live sinks stopped ({type(exc).__name__}: {exc})")
    try:
        conn.send(feed.failures)
        conn.close()
    except OSError:  # nobody to report to
        pass


class LiveSinks:
    """Feeds ``sinks`` the committed events of one run session (see the module docstring).

    Args:
        run_dir: the run directory (sinks place their default output under it).
        log: the run's event log, read on the training thread only (:meth:`collect`).
        start: the first seq of this session (``run_started``'s or ``run_resumed``'s); the log is
            read from 0 when a sink is ``from_start`` (:class:`Sink`), the others still fed from ``start``.
        sinks: the sinks; the ``out_of_process`` ones run in a forked child, the others on a thread.
    """

    def __init__(self, run_dir: Path, log: Any, start: int, sinks: Sequence[Sink]) -> None:
        self.run_dir, self.log = Path(run_dir), log
        self.next = 0 if any(getattr(s, "from_start", False) for s in sinks) else start
        far = [s for s in sinks if getattr(s, "out_of_process", False)]
        near = [s for s in sinks if not getattr(s, "out_of_process", False)]
        self._proc: Any = None
        self._conn: Any = None
        if far:
            parent, child = multiprocessing.get_context("fork").Pipe()
            self._proc = multiprocessing.get_context("fork").Process(
                target=_child, args=(child, _Feed(self.run_dir, far, start), parent), name="nnx_es-sinks",
                daemon=True)
            self._proc.start()
            child.close()
            self._conn = parent
        self._near = _Feed(self.run_dir, near, start) if near else None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self._near is not None:
            self._thread = threading.Thread(target=self._near.run, args=(self._batches(),), name="nnx_es-sinks",
                                            daemon=True)
            self._thread.start()

    def _batches(self) -> Iterator[list[tuple[int, bytes]]]:
        while (batch := self._queue.get()) is not _END:
            yield batch

    def collect(self, *_: Any) -> None:
        """Hand on the values written since the last call (training thread; nothing when nothing is new)."""
        end = self.log.durable_seq
        if end > self.next:
            batch = list(self.log.read_raw(self.next, end))
            self.next = end
            if self._thread is not None:
                self._queue.put(batch)
            if self._conn is not None:
                try:
                    self._conn.send(batch)
                except OSError:  # the child died: its sinks are gone, the run goes on
                    self._conn = None

    def close(self, timeout_s: float = 30.0) -> None:
        """Hand on what is left, then wait (at most ``timeout_s``) for the sinks to write it and close;
        warn (:class:`SinkWarning`) about every sink that failed."""
        failures: list[str] = []
        try:
            self.collect()
        finally:
            if self._thread is not None:
                self._queue.put(_END)
                self._thread.join(timeout_s)
                failures += self._near.failures if self._near is not None else []
            if self._conn is not None:
                try:
                    self._conn.send(_END)
                    if self._conn.poll(timeout_s):
                        failures += self._conn.recv()
                    else:
                        failures.append(f"live sinks did not finish within {timeout_s} s")
                except (OSError, EOFError):
                    failures.append("the live sinks' process ended early")
            if self._proc is not None:
                self._proc.join(timeout_s)
                if self._proc.is_alive():
                    self._proc.kill()
        for why in failures:
            warnings.warn(why, SinkWarning, stacklevel=2)
            log.warning("live sink", error=why)
