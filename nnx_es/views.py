"""Materialized views of a run's projections, for people and other tools.

Two files under ``runs/<id>/views/``, regenerable from the log and never read
back as truth (DESIGN.md "The run directory"):

* ``history.csv``: one row per committed epoch (:class:`events.HistoryRecord`):
  ``epoch``, the training metrics, the validation metrics, ``monitor_value``,
  ``improved``, the learning rates flattened as ``lr/<optimizer>/<group>``,
  the counters as ``counters/<name>``, then ``wall_time_s``;
* ``summary.json``: status, run id, committed epochs, LAST/BEST/phase
  pointers, counters and scheduler states.

Formatting is deterministic so the audit (invariant 9) can compare bytes:
floats are written with ``repr`` (``nan``/``inf`` in the CSV, ``NaN``/
``Infinity`` in JSON), booleans as ``true``/``false``, a missing value as an
empty CSV field, JSON keys sorted, ``\\n`` line endings, UTF-8.
"""

from __future__ import annotations

import csv
import io
import json
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from events.paths import read_file
from events.schema import Counters, HistoryRecord
from nnx_es.storage import UNSIZED_MAX, atomic_write_all
from projections import Projections

__all__ = ["HISTORY_CSV", "SUMMARY_JSON", "VIEW_FILES", "expected_views", "read_views", "summary", "write_views"]

#: View files, relative to the run directory.
HISTORY_CSV = "views/history.csv"
SUMMARY_JSON = "views/summary.json"
VIEW_FILES: tuple[str, ...] = (HISTORY_CSV, SUMMARY_JSON)

_COUNTER_FIELDS: tuple[str, ...] = tuple(Counters.__struct_fields__)
_counters = operator.attrgetter(*_COUNTER_FIELDS)  # a Counters' fields, in order
_FIXED_COLUMNS = frozenset({"epoch", "monitor_value", "improved", "wall_time_s"})


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _history_csv(records: tuple[HistoryRecord, ...]) -> bytes:
    """The CSV of ``records``; columns are the union over every record, in a fixed order."""
    train_keys = sorted({k for r in records for k in r.train})
    val_keys = sorted({k for r in records for k in r.val})
    lr_keys = sorted({(opt, i) for r in records for opt, lrs in r.lrs.items() for i in range(len(lrs))})
    taken = _FIXED_COLUMNS | set(val_keys)

    def train_column(key: str) -> str:
        # a training metric named like another column is prefixed, never silently merged
        clash = key in taken or key.startswith(("lr/", "counters/", "train/"))
        return f"train/{key}" if clash else key

    header = [
        "epoch",
        *(train_column(k) for k in train_keys),
        *val_keys,
        "monitor_value",
        "improved",
        *(f"lr/{opt}/{i}" for opt, i in lr_keys),
        *(f"counters/{name}" for name in _COUNTER_FIELDS),
        "wall_time_s",
    ]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for r in records:  # a row's values through map: no generator frame per cell
        lrs = [r.lrs[opt][i] if i < len(r.lrs.get(opt, ())) else None for opt, i in lr_keys]
        writer.writerow(map(_cell, [
            r.epoch, *map(r.train.get, train_keys), *map(r.val.get, val_keys), r.monitor_value, r.improved,
            *lrs, *_counters(r.counters), r.wall_time_s,
        ]))
    return buf.getvalue().encode("utf-8")


def summary(p: Projections) -> dict[str, Any]:
    """The run summary as JSON-ready builtins (what ``summary.json`` holds)."""
    records = p.history.records
    ck = p.checkpoints
    return {
        "run_id": p.status.run_id,
        "status": p.status.status,
        "stop_reason": p.status.stop_reason,
        "error_type": p.status.error_type,
        "error": p.status.error,
        "resumes": p.status.resumes,
        "epochs": len(records),
        "last_epoch": records[-1].epoch if records else None,
        "last": msgspec.to_builtins(ck.last),
        "best": msgspec.to_builtins(ck.best),
        "phases": msgspec.to_builtins(ck.phases),
        "counters": msgspec.to_builtins(p.counters),
        "schedulers": {
            name: {"clock": s.clock, "steps": s.steps, "lrs": list(s.lrs), "plateau": msgspec.to_builtins(s.plateau)}
            for name, s in p.schedulers.by_name.items()
        },
    }


def _summary_json(p: Projections) -> bytes:
    return (json.dumps(summary(p), sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def expected_views(p: Projections) -> dict[str, bytes]:
    """The exact bytes of every view file for projections ``p`` (path relative to the run dir -> bytes)."""
    return {HISTORY_CSV: _history_csv(p.history.records), SUMMARY_JSON: _summary_json(p)}


def write_views(run_dir: Path, p: Projections) -> None:
    """Write every view of ``p`` under ``run_dir/views/`` atomically (temporary, fsync, rename), without
    following a link below ``run_dir`` (:func:`~nnx_es.storage.atomic_write_all`).

    Raises:
        UnsafePathError: ``views/`` is a symbolic link or not a directory; nothing was written.
        CheckpointWriteError: a file could not be made durable; it keeps its previous bytes.
    """
    atomic_write_all([(Path(run_dir) / rel, data) for rel, data in expected_views(p).items()], root=Path(run_dir))


def read_views(run_dir: Path, limits: Mapping[str, int] | None = None) -> dict[str, bytes]:
    """The view files present under ``run_dir`` (relative path -> bytes); absent ones are left out.

    ``limits``: the most bytes each may hold (the audit's: the size it expects); a file is read to at
    most one byte more (default :data:`~nnx_es.storage.UNSIZED_MAX`). Regular files only, no link followed.

    Raises:
        UnsafePathError: ``views/`` or a view file is a symbolic link, a FIFO, a device, ...
    """
    found: dict[str, bytes] = {}
    for rel in VIEW_FILES:
        data = read_file(run_dir, rel.split("/"), limit=(limits or {}).get(rel, UNSIZED_MAX))
        if data is not None:
            found[rel] = data
    return found
