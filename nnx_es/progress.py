"""A progress display while training on a terminal (rich); silent otherwise."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    """Epoch, step, loss and rows/s on stderr when it is a terminal (or when forced on); nothing otherwise.

    Forced on (``enabled=True``) where stderr is no terminal, the display is drawn there all the
    same (terminal control codes included), as a terminal would show it.

    Raises:
        ConfigError: ``enabled`` is not True, False or None.
    """

    def __init__(self, enabled: bool | None = None) -> None:
        if enabled is not None and not isinstance(enabled, bool):
            from nnx_es.errors import ConfigError

            raise ConfigError(f"progress must be True, False or None (on when stderr is a terminal), got {enabled!r}")
        self._forced = enabled is True
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar: Any = None
        self._task: Any = None
        self._rows = 0
        self._t0 = 0.0
        self._loss = "-"

    def start_epoch(self, epoch: int, total: int | None, epochs: int | None = None) -> None:
        """Epoch ``epoch`` (0-based) of ``epochs`` begins, with ``total`` batches (None: unknown)."""
        if not self.enabled:
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            # on stderr, where the decision to show it was made (stdout stays the program's own)
            console = Console(stderr=True, force_terminal=True if self._forced else None)
            self._bar = RichProgress(
                TextColumn("epoch {task.fields[epoch]}{task.fields[of]}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("step {task.fields[step]}  loss {task.fields[loss]}  {task.fields[rate]} rows/s"),
                TimeElapsedColumn(), transient=True, console=console,
                # prints go where they would: kept above the display on a terminal, into a redirected stdout as they are
                redirect_stdout=sys.stdout.isatty(),
            )
            self._bar.start()
        if self._task is not None:
            self._bar.remove_task(self._task)
        of = f" (of 0-{epochs - 1})" if epochs else ""  # epochs are 0-based, as in the log
        self._task = self._bar.add_task("train", total=total, epoch=epoch, of=of, step=0, loss="-", rate="-")
        self._loss = "-"
        self._rows = 0
        self._t0 = time.perf_counter()

    def advance(self, loss: float | None, step: int, rows: int = 1) -> None:
        """One microbatch of ``rows`` rows done; ``loss`` is its mean loss (``None``: not read for this
        microbatch, the last one shown stays), ``step`` the committed updates."""
        if not self.enabled or self._task is None:
            return
        self._rows += rows
        dt = time.perf_counter() - self._t0
        if loss is not None:
            self._loss = f"{loss:.4f}" if math.isfinite(loss) else "-"
        self._bar.update(self._task, advance=1, step=step, loss=self._loss,
                         rate=f"{self._rows / dt:.0f}" if dt > 0 else "-")

    def end_epoch(self, epoch: int, record: Any) -> None:
        """The epoch's committed history ``record``: one line with its training and validation metrics."""
        if not self.enabled or self._bar is None:
            return
        metrics = {**record.train, **record.val}
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        mark = "  *" if record.improved else ""
        self._bar.console.print(f"epoch {epoch}: {shown}{mark}", highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            self._task = None
