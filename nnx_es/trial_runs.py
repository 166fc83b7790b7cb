"""One trial of a plan or a search as a run of its own: train it (or finish it), and read what it achieved.

Both :class:`nnx_es.ExperimentPlan` and :func:`nnx_es.search.search` train each trial as an ordinary
run under their runs root, with a run id they derive from the trial (so a restart finds it), and read
its outcome back from the run's own log -- the projections of its committed view -- never from a copy:

* :func:`run_outcome`: status, stop reason, the monitor and its BEST, the monitor value of each
  committed epoch, the spec the run recorded;
* :func:`train_trial`: a finished run (completed / stopped / failed) is taken as it is, nothing
  trained; otherwise the run is built from the trial's spec and fitted with ``resume="auto"``: a run
  with a committed LAST continues from it bit for bit (``Trainer.fit``), one without is started
  afresh. A run already there that recorded another spec is refused, never resumed or cleared.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from events.errors import EventLogError
from events.log import LmdbLog
from events.schema import RunStarted
from nnx_es.errors import ConfigError, LeaseHeldError, NnxError, UnsafePathError
from nnx_es.recipes.imports import Allowed
from nnx_es.recipes.runspec import RunSpec, build_run, spec_hash
from nnx_es.storage import check_run_dir

__all__ = ["FINISHED", "RunOutcome", "TrialRun", "better", "run_outcome", "train_trial"]

#: the statuses of a run that has ended for good (``interrupted``, a Ctrl-C, is resumed like a kill)
FINISHED = ("completed", "stopped", "failed")


class RunOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What a run's log says it achieved (its committed view).

    status: ``completed`` | ``stopped`` | ``failed`` | ``interrupted`` | ``running`` | ``new`` | ``failing``;
    stop_reason: ``early_stopping``, ``pruned``, ... when it stopped. monitor / mode: the monitor's
    name and ``min`` | ``max`` (None without a monitor); best / best_epoch: its BEST (value and
    0-based epoch; None without one); values: the monitor value of each committed epoch (None where
    no decision was made), in epoch order; spec / spec_hash: what its ``run_started`` recorded.
    """

    run_id: str
    status: str
    stop_reason: str | None = None
    monitor: str | None = None
    mode: str | None = None
    best: float | None = None
    best_epoch: int | None = None
    values: tuple[float | None, ...] = ()
    spec: dict[str, Any] | None = None
    spec_hash: str = ""
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Whether the run has ended for good (:data:`FINISHED`)."""
        return self.status in FINISHED

    @property
    def epochs(self) -> int:
        """Committed epochs."""
        return len(self.values)


def run_outcome(run_dir: str | Path) -> RunOutcome | None:
    """The outcome of the run at ``run_dir``, folded from its log read-only; None when it has no log yet.

    Raises:
        UnsafePathError: the run directory's log is a link or of the wrong kind.
        EventLogError / CorruptEventError: the log cannot be read (damaged, or being created).
    """
    from nnx_es.audit.snapshots import project_log

    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    if not (run_dir / "events.lmdb" / "data.mdb").exists():
        return None
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        first = next(iter(log.read(0, 1)), None)
        p = project_log(log).projections
    started = first[1] if first is not None and isinstance(first[1], RunStarted) else None
    monitor = started.monitor if started is not None else None
    best = p.checkpoints.best
    return RunOutcome(
        run_id=p.status.run_id or run_dir.name, status=p.status.status, stop_reason=p.status.stop_reason,
        monitor=monitor.name if monitor else None, mode=monitor.mode if monitor else None,
        best=best.value if best is not None else None, best_epoch=best.epoch if best is not None else None,
        values=tuple(r.monitor_value for r in p.history.records),
        spec=started.spec if started is not None else None, spec_hash=started.spec_hash if started is not None else "",
        error=p.status.error,
    )


def better(a: float, b: float, mode: str | None) -> bool:
    """Whether monitor value ``a`` is better than ``b`` in ``mode`` (``max``: higher; else lower)."""
    return a > b if mode == "max" else a < b


class TrialRun(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`train_trial` did. outcome: the run's (None: no run was made); trained: this call
    trained it (False: it had finished before); resumed: it continued a run that was there;
    error: why the run failed or was refused (``ExceptionType: message``)."""

    outcome: RunOutcome | None
    trained: bool = False
    resumed: bool = False
    error: str | None = None


def train_trial(spec: RunSpec, *, runs_root: Path, run_id: str, allowed: Allowed,
                prepare: Callable[[Any], None] | None = None, progress: bool | None = None) -> TrialRun:
    """Train (or finish, or leave as it is) the run ``runs_root/run_id`` of ``spec``.

    ``prepare(built)``: called with the :class:`~nnx_es.recipes.runspec.BuiltRun` before ``fit`` (the
    search hands its pruning callback the trial there).

    A run that fails while training is recorded in its log (status ``failed``) and returned with its
    error; a trial refused before its run began (a constructor refusing a value, a resume refusal)
    returns ``outcome`` None or unchanged, with the error.

    Raises:
        ConfigError: the run is there and recorded another spec than ``spec`` builds (not this trial's).
        LeaseHeldError: another process writes the run. UnsafePathError / EventLogError: its
            directory holds a link or a damaged log (nothing done).
    """
    run_dir = runs_root / run_id
    before = run_outcome(run_dir)
    if before is not None and before.finished:
        return TrialRun(outcome=before, error=before.error)
    try:
        built = build_run(spec, allowed=allowed, runs_root=runs_root, run_id=run_id, progress=progress)
    except NnxError as exc:  # a value the trial gave that a constructor refuses: nothing was written
        return TrialRun(outcome=before, error=f"{type(exc).__name__}: {exc}")
    if before is not None and before.spec_hash and before.spec_hash != spec_hash(built.trainer.spec):
        raise ConfigError(f"run {run_id!r} in {str(runs_root)!r} was started from another spec than this trial's: "
                          "not resumed or cleared; another plan or search wrote it (use another name, or move it away)")
    if prepare is not None:
        prepare(built)
    error = None
    try:
        built.trainer.fit(built.train_loader, built.val_loader, epochs=built.epochs, resume="auto")
    except (LeaseHeldError, UnsafePathError, EventLogError):
        raise
    except Exception as exc:  # the run failed (recorded in its log) or was refused before it began
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    after = run_outcome(run_dir)
    return TrialRun(outcome=after, trained=True, resumed=before is not None and before.status != "new", error=error)
