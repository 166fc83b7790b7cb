"""An experiment plan's own log: ``RUNS_ROOT/plans/<name>/events.lmdb``, beside the plan's runs.

The same LMDB log a run keeps (:class:`events.log.LmdbLog`: contiguous keys, a CRC-32 per write,
every ``commit`` synced before it returns) holding the plan's events (:mod:`events.plans`), folded
by :func:`projections.plans.fold_plan`. One process writes it at a time: the writer holds the
lease a run's writer holds (:class:`nnx_es.lease.Lease`, keyed on ``plans/<name>``), so a second
``fit`` of the same plan is refused while the first is alive, and a killed one frees it.

Nothing under the plan's directory is followed (DESIGN.md "Trust boundaries"): ``plans`` and
``plans/<name>`` are opened without following a link, its log checked like a run's
(:func:`nnx_es.storage.check_run_dir`); the log's keys and checksums are verified when it is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from events.errors import CorruptEventError
from events.log import LmdbLog
from events.paths import check_entry, open_dir
from events.plans import decode_plan_event
from events.schema import Event
from nnx_es.errors import LeaseHeldError
from nnx_es.lease import Lease, validate_run_id
from nnx_es.storage import check_run_dir
from projections.plans import PlanState, fold_plan, project_plan

__all__ = ["PLANS_DIR", "PlanLog", "read_plan"]

#: the directory of a runs root that holds the plans' logs (``plans/<name>/events.lmdb``)
PLANS_DIR = "plans"


def _events(log: LmdbLog) -> list[tuple[int, Event]]:
    """Every event of the plan log, its keys and checksums verified first.

    Raises:
        SequenceGapError: a key out of place; CorruptEventError: a value that does not verify or decode.
    """
    log.check_keys()
    for problem in log.verify_sums():
        if problem.problem != "uncovered":
            raise CorruptEventError(problem.first, f"plan log values seq {problem.first}..{problem.last} do not "
                                                   f"match their checksum ({problem.problem}): the log was changed")
    return [(seq, decode_plan_event(raw, seq)) for seq, raw in log.read_raw()]


class PlanLog:
    """The log of plan ``name`` under ``runs_root``, open for writing under its lease (a context manager).

    Raises:
        LeaseHeldError: another process is running this plan.
        UnsafePathError: ``plans``, ``plans/<name>`` or the log is a link or of the wrong kind.
        EventLogError / CorruptEventError / SequenceGapError: the log is damaged (named).
    """

    def __init__(self, runs_root: Path, name: str) -> None:
        self.runs_root = Path(runs_root)
        self.name = validate_run_id(name)
        self.dir = self.runs_root / PLANS_DIR / name
        self._lease: Lease | None = None
        self._log: LmdbLog | None = None
        self.state = PlanState()

    def __enter__(self) -> PlanLog:
        self.runs_root.mkdir(parents=True, exist_ok=True)  # the runs root is the caller's: as named
        os.close(open_dir(self.runs_root, (PLANS_DIR, self.name), create=True))  # no link followed
        lease = Lease(self.runs_root / PLANS_DIR, self.name)
        try:
            lease.acquire()
        except LeaseHeldError:
            raise LeaseHeldError(f"plan {self.name!r} is being run by another process (its lease under "
                                 f"{self.runs_root / PLANS_DIR} is held); wait for it, or stop it") from None
        self._lease = lease
        try:
            check_run_dir(self.dir)
            self._log = LmdbLog(self.dir / "events.lmdb")
            self.state = project_plan(_events(self._log))
        except BaseException:
            self.__exit__()
            raise
        return self

    def commit(self, event: Event) -> None:
        """Append ``event`` and make it durable (synced) before returning; fold it into :attr:`state`."""
        assert self._log is not None, "PlanLog.commit outside its with-block"
        self._log.commit(event)
        self.state = fold_plan(self.state, event)

    def __exit__(self, *exc: Any) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def read_plan(runs_root: Path, name: str) -> PlanState | None:
    """The state of plan ``name``'s log under ``runs_root``, read-only (beside a live writer); None when it
    has no log.

    Raises:
        UnsafePathError / EventLogError / CorruptEventError / SequenceGapError: as :class:`PlanLog`.
    """
    plan_dir = Path(runs_root) / PLANS_DIR / validate_run_id(name)
    for entry in (plan_dir.parent, plan_dir):
        check_entry(entry, "dir")
    check_run_dir(plan_dir)
    if not (plan_dir / "events.lmdb" / "data.mdb").exists():
        return None
    with LmdbLog(plan_dir / "events.lmdb", readonly=True) as log:
        return project_plan(_events(log))
