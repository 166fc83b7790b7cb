"""What a finished (or opened) run looks like to its caller: projections of its log."""

from __future__ import annotations

from pathlib import Path

import msgspec

from events.log import LmdbLog
from events.schema import Counters, HistoryRecord
from projections.checkpoints import Pointer
from projections.view import Projections

__all__ = ["RunResult", "load_result", "loadable", "open_projections", "result_of"]


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """A run, rebuilt from its event log's committed view.

    status: ``completed`` | ``stopped`` | ``failed`` | ``interrupted`` | ``running``.
    history: one record per committed epoch. best / last: checkpoint pointers.
    events: number of events in the log (uncommitted tail included).
    """

    run_id: str
    run_dir: str
    status: str
    history: tuple[HistoryRecord, ...]
    best: Pointer | None
    last: Pointer | None
    counters: Counters
    events: int
    error: str | None = None
    #: manifest -> why retention pruned it (its bytes are gone on purpose)
    pruned: dict[str, str] = {}

    @property
    def best_epoch(self) -> int | None:
        return self.best.epoch if self.best is not None else None

    def __repr__(self) -> str:
        best = f"epoch {self.best.epoch}" if self.best is not None else "none"
        return (f"RunResult(run_id={self.run_id!r}, status={self.status!r}, epochs={len(self.history)}, "
                f"steps={self.counters.step}, best={best}, events={self.events}, run_dir={self.run_dir!r})")


def open_projections(run_dir: str | Path) -> tuple[Projections, int]:
    """Fold a run's committed view read-only; return (projections, number of events).

    Folded from the newest usable projection snapshot on (:func:`nnx_es.audit.project_log`:
    O(events since it)); damage to the log's values before that snapshot is not seen here
    (``inspect summary``, a resume and ``tools/replay`` report it).

    Raises:
        CorruptEventError: a value after the snapshot does not decode (names its seq).
        EventLogError: the log cannot be opened or read.
    """
    from nnx_es.audit.snapshots import project_log

    with LmdbLog(Path(run_dir) / "events.lmdb", readonly=True) as log:
        return project_log(log).projections, log.next_seq


def load_result(run_dir: str | Path) -> RunResult:
    """Rebuild a :class:`RunResult` from ``runs/<id>/``."""
    p, n = open_projections(run_dir)
    return result_of(p, run_dir, n)


def result_of(p: Projections, run_dir: str | Path, n: int) -> RunResult:
    """The :class:`RunResult` of projections ``p`` of a log of ``n`` events."""
    return RunResult(
        run_id=p.status.run_id or Path(run_dir).name,
        run_dir=str(run_dir),
        status=p.status.status,
        history=p.history.records,
        best=p.checkpoints.best,
        last=p.checkpoints.last,
        counters=p.counters,
        events=n,
        error=p.status.error,
        pruned=dict(p.checkpoints.pruned),
    )


def loadable(result: RunResult, which: str) -> Pointer:
    """The run's ``"best"`` or ``"last"`` checkpoint pointer, to load its weights from.

    Raises:
        CheckpointUnavailableError: the run committed no such checkpoint, or retention pruned it
            (its reason named, and the setting that keeps it).
    """
    from nnx_es.errors import CheckpointUnavailableError

    pointer = result.best if which == "best" else result.last
    if pointer is None:
        raise CheckpointUnavailableError(f"run {result.run_id!r} has no committed {which.upper()} checkpoint")
    if pointer.manifest in result.pruned:
        raise CheckpointUnavailableError(
            f"the {which.upper()} checkpoint of run {result.run_id!r} (epoch {pointer.epoch}) was pruned by checkpoint "
            f"retention ({result.pruned[pointer.manifest]}): train with keep_best=True (the default) to keep BEST's, "
            "or keep_last=None to keep every one")
    return pointer
