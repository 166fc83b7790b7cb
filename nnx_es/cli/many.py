"""``inspect`` over several runs: the runs under a root, and where two runs first differ.

``tools/inspect runs/`` (a directory holding runs rather than a run) lists each run: id, status
(a run not finalized that no process on this machine writes any more: "running (no writer)"; a
run whose keys or checksums do not verify: "damaged"), committed epochs, BEST's monitored value,
when it started, and its size on disk.
``tools/inspect diff runs/a runs/b`` names the first event where two runs' logs differ -- a loss,
a learning rate, a batch -- ignoring what differs between any two runs (wall clock times, run ids,
library versions, the hashes of checkpoints that hold another run id): for reproducibility and
resume debugging. Both logs are verified first (keys and checksums): damage is said as damage
(exit 2), never as a difference. Both read the logs read-only; every string is escaped for the
terminal (:func:`nnx_es.cli._format.printable`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from events.errors import CorruptEventError, DamagedLogError, EventLogError, UnsafePathError
from events.log import LmdbLog
from events.paths import check_entry
from nnx_es.audit import NotARunError, log_damage, open_run_log
from nnx_es.cli._common import EXIT_OK, EXIT_UNUSABLE, fail, reader_left, writer_alive
from nnx_es.cli._format import json_line, printable
from nnx_es.result import load_result
from nnx_es.storage import check_run_dir
from projections.status import UNFINISHED

__all__ = ["RunRow", "diff_command", "first_difference", "is_empty_runs_root", "is_runs_root", "list_command",
           "list_runs", "run_dirs"]

#: fields that differ between any two runs, whatever they computed (``previous``: the journal
#: manifest before, a hash of a blob naming its run, like ``manifest``)
_INCIDENTAL = frozenset({"wall_time_s", "duration_s", "library_versions", "run_id", "started_at", "manifest",
                         "previous", "blobs", "components", "traceback", "cleaned_temporaries"})


class RunRow(msgspec.Struct, frozen=True, kw_only=True):
    """One run of a runs root. best: BEST's monitored value (None: no BEST); started: ISO time, UTC;
    writer_alive: for a run not finalized, whether a process on this machine still holds its writer
    lease (False: killed or crashed? see :func:`nnx_es.cli._common.writer_alive`), None for a finalized one."""

    run_id: str
    status: str
    epochs: int | None  # None: unreadable
    best: float | None
    started: str | None
    bytes: int
    writer_alive: bool | None = None
    #: why an ``unreadable`` run could not be read (the error's type and message), or what of a ``damaged``
    #: one does not verify (:func:`nnx_es.audit.log_damage`); None otherwise
    error: str | None = None
    #: for an ``unreadable`` or ``damaged`` run: what to do about it, when ``error`` does not say it already
    advice: str | None = None


def is_runs_root(path: Path) -> bool:
    """Whether ``path`` holds runs (``<id>/events.lmdb``) rather than being one."""
    return path.is_dir() and not (path / "events.lmdb").is_dir() and any(run_dirs(path))


def is_empty_runs_root(path: Path) -> bool:
    """Whether ``path`` is a runs root before its first run: a directory holding nothing but hidden
    entries (what a runs root keeps beside its runs, e.g. ``.leases``). Listed as zero runs; a
    directory holding anything else (files, other directories) is neither a run nor a runs root,
    and is refused as not a run rather than listed as an empty one."""
    return path.is_dir() and not (path / "events.lmdb").exists() and all(p.name.startswith(".")
                                                                          for p in path.iterdir())


#: what a run directory holds besides its log: a directory with one of these but no readable log is
#: a run whose log is gone (listed unreadable, not left out)
_RUN_PARTS = ("events.lmdb", "blobs", "views")


def run_dirs(root: Path) -> Iterator[Path]:
    """The entries of ``root`` that hold a run's parts (:data:`_RUN_PARTS`), by name; hidden ones left out.
    An entry may be a symbolic link (``is_dir`` follows it): its reader refuses it (:func:`events.paths.check_entry`)."""
    for p in sorted(root.iterdir()):
        if not p.name.startswith(".") and any((p / part).is_dir() for part in _RUN_PARTS):
            yield p


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "lock.mdb")


def list_runs(root: Path) -> list[RunRow]:
    """Every run under ``root``, by id. A run whose log cannot be read is listed with status ``unreadable``,
    the reason in ``error`` and what to do in ``advice`` (a directory holding a run's parts without its
    log is listed so too, not left out); a run whose keys or checksums do not verify
    (:func:`nnx_es.audit.log_damage`: every log read whole, ~0.3 s a million events) with status ``damaged``; so is
    an entry that is a symbolic link: never followed."""
    rows = []
    for run_dir in run_dirs(root):
        try:
            check_entry(run_dir, "dir")  # a run found by id in a runs root is never a link (events.paths)
            with open_run_log(run_dir) as log:
                damage = log_damage(log)
            if damage is not None:
                rows.append(RunRow(run_id=run_dir.name, status="damaged", epochs=None, best=None, started=None,
                                   bytes=_size(run_dir), error=damage,
                                   advice=f"tools/replay {run_dir} names the damage; restore the run directory from a copy"))
                continue
        except NotARunError as exc:  # its log is gone: the message says so and what to do
            rows.append(_unreadable(run_dir, exc, None))
            continue
        except Exception as exc:  # noqa: BLE001 - one damaged run does not hide the others
            rows.append(_unreadable(run_dir, exc, "its log cannot be opened: restore the run directory from a "
                                                  "copy, or remove it"))
            continue
        try:
            r = load_result(run_dir)
            with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
                first = next(iter(log.read(0, 1)), None)
            t = getattr(first[1], "wall_time_s", None) if first is not None else None
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t else None
            best = r.best.value if r.best is not None else None
            alive = writer_alive(run_dir) if r.status in UNFINISHED else None
            rows.append(RunRow(run_id=run_dir.name, status=r.status, epochs=len(r.history), best=best,
                               started=started, bytes=_size(run_dir), writer_alive=alive))
        except Exception as exc:  # noqa: BLE001
            rows.append(_unreadable(run_dir, exc, f"tools/replay {run_dir} audits every event and names the damage"))
    return rows


def _unreadable(run_dir: Path, exc: BaseException, advice: str | None) -> RunRow:
    return RunRow(run_id=run_dir.name, status="unreadable", epochs=None, best=None, started=None,
                  bytes=0 if run_dir.is_symlink() else _size(run_dir), error=f"{type(exc).__name__}: {exc}", advice=advice)


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _INCIDENTAL}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _comparable(event: Any) -> Any:
    """The event as builtins without what differs between any two runs (at any depth)."""
    return _strip(msgspec.to_builtins(event))


def _first_field(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any]:
    """The first (dotted) field where ``a`` and ``b`` differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if a.get(k) != b.get(k):
                return _first_field(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_field(x, y, f"{path}[{i}]")
    return path or "(event)", a, b


def first_difference(a: Path, b: Path) -> dict[str, Any] | None:
    """Where the logs of runs ``a`` and ``b`` first differ: ``{"seq", "kind_a", "kind_b", "field", "a", "b"}``
    (``kind_x`` None where one log ends first); None when they hold the same events (also when
    both name one log: LMDB opens an environment once per process). Of two ``run_started`` events,
    other ``initial_weights`` are named before any other field: they explain what follows.

    Raises:
        DamagedLogError: a log's keys or checksums do not verify (:func:`nnx_es.audit.log_damage`), named.
        CorruptEventError: a value does not decode (its seq named).
        EventLogError: a log cannot be opened or read.
        UnsafePathError: a run's log (or a file of it) is a symbolic link or of the wrong kind: not read.
    """
    for run in (a, b):  # before the paths are resolved: a link under a run is refused, never followed
        check_run_dir(run)
    if (a / "events.lmdb").resolve() == (b / "events.lmdb").resolve():
        return None
    with LmdbLog(a / "events.lmdb", readonly=True) as la, LmdbLog(b / "events.lmdb", readonly=True) as lb:
        for run, log in ((a, la), (b, lb)):
            if (damage := log_damage(log)) is not None:
                raise DamagedLogError(f"the event log of {run} is damaged: {damage}")
        ia, ib = la.read(), lb.read()
        while True:
            ea, eb = next(ia, None), next(ib, None)
            if ea is None and eb is None:
                return None
            if ea is None or eb is None:
                seq = (ea or eb)[0]  # type: ignore[index]
                return {"seq": seq, "kind_a": ea[1].KIND if ea else None, "kind_b": eb[1].KIND if eb else None,
                        "field": "(end of log)", "a": None, "b": None}
            (seq, x), (_, y) = ea, eb
            if x.KIND != y.KIND:
                return {"seq": seq, "kind_a": x.KIND, "kind_b": y.KIND, "field": "kind", "a": x.KIND, "b": y.KIND}
            cx, cy = _comparable(x), _comparable(y)
            if cx != cy:
                # other initial weights explain every difference after them: said first (a seed, a model)
                field, va, vb = ("initial_weights", cx["initial_weights"], cy["initial_weights"]) \
                    if x.KIND == "run_started" and cx.get("initial_weights") != cy.get("initial_weights") \
                    else _first_field(cx, cy)
                return {"seq": seq, "kind_a": x.KIND, "kind_b": y.KIND, "field": field, "a": va, "b": vb}


def list_command(root: Path, as_json: bool) -> int:
    """``inspect RUNS_ROOT [--json]``: one row (one JSON object) per run; exit 0, or 1 when a run is unreadable
    or damaged.

    A runs root with no run yet (:func:`is_empty_runs_root`) lists none: a line saying so (on stderr
    under ``--json``, whose stdout then holds no row), exit 0."""
    rows = list_runs(root)
    status = 1 if any(r.error is not None for r in rows) else EXIT_OK
    if not rows:
        print(f"no runs under {root} yet (a run's directory appears here when it starts)",
              file=sys.stderr if as_json else sys.stdout)
        return status
    try:
        _print_runs(rows, as_json)
    except BrokenPipeError:  # inspect runs/ --json | head: the status stands, whatever was read
        reader_left()
    return status


def _print_runs(rows: list[RunRow], as_json: bool) -> None:
    if as_json:
        for row in rows:
            sys.stdout.write(json_line(row) + "\n")
        return
    header = ("run", "status", "epochs", "best", "started", "size")
    table = [header] + [(r.run_id, r.status + (" (no writer)" if r.writer_alive is False else ""),
                         "-" if r.epochs is None else str(r.epochs), "-" if r.best is None else f"{r.best:.6g}",
                         r.started or "-", f"{r.bytes / 2**20:.1f} MiB") for r in rows]
    table = [tuple(printable(cell) for cell in row) for row in table]  # a run id is someone else's text
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        sys.stdout.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
    for r in rows:  # why, under the table: a reason does not fit a column
        if r.error is not None:
            sys.stdout.write(printable(f"{r.run_id}: {r.status}: {r.error}" + (f"; {r.advice}" if r.advice else ""))
                             + "\n")


_DIFF_HELP = """usage: inspect diff RUN_A RUN_B [--json]

The first event where two runs differ (seq, kind, field, both values), wall clock times, ids and checkpoint
hashes aside. --json: one object {"same": ..., "first_difference": ...}.

Exit status: 0 the same, 1 they differ, 2 unusable input or a damaged log (keys or checksums that do not
verify, a value that does not decode: said as damage, never as a difference).
"""


def diff_command(argv: list[str], as_json: bool) -> int:
    """``inspect diff RUN_A RUN_B [--json]``: exit 0 the same, 1 they differ, 2 unusable input or a damaged log
    (keys or checksums that do not verify, a value that does not decode: said as damage, never as a difference)."""
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(_DIFF_HELP)
        return EXIT_OK
    runs = [a for a in argv if a != "--json"]
    if len(runs) != 2 or len(argv) - len(runs) > 1:
        return fail("inspect", "diff takes two run directories (and --json): inspect diff RUN_A RUN_B",
                    error_type="UsageError", as_json=as_json)
    a, b = (Path(r) for r in runs)
    for r in (a, b):
        if not (r / "events.lmdb" / "data.mdb").exists():
            return fail("inspect", f"{r} is not a run directory (no events.lmdb)", error_type="NotARunError",
                        as_json=as_json)
    try:
        found = first_difference(a, b)
    except (EventLogError, CorruptEventError, UnsafePathError) as exc:  # damage or a link, not a difference: exit 2
        return fail("inspect", f"{exc}; nothing was compared; run tools/replay on each run to audit it",
                    error_type=type(exc).__name__, as_json=as_json, status=EXIT_UNUSABLE)
    if as_json:
        sys.stdout.write(json_line({"same": found is None, "first_difference": found}) + "\n")
    elif found is None:
        sys.stdout.write(printable(f"{a} and {b} hold the same events (wall clock times, ids and checkpoint hashes "
                                   "aside)") + "\n")
    else:
        # run_started is event 0, so two runs that began from other weights say so before any loss differs
        lead = "initial weights differ: " if found["field"] == "initial_weights" else ""
        sys.stdout.write(printable(f"{lead}first difference at seq {found['seq']}: {found['kind_a']} / "
                                   f"{found['kind_b']}, {found['field']}: {found['a']!r} in {a}, {found['b']!r} in "
                                   f"{b}") + "\n")
    return EXIT_OK if found is None else 1
